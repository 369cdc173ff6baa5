"""Deterministic training text for the shipped tiny tokenizer.

The tokenizer in ``atroposlib/tiny_model/assets`` is trained (by
``scripts/build_tiny_tokenizer.py``) on text generated here rather than on a
downloaded corpus, so the repository stays offline and reproducible. The text
covers what the demo environments and tests send through a model: arithmetic
questions and answers, ChatML-formatted exchanges, simple English, ``\\boxed{}``
answers, ``<think>`` blocks, JSON tool calls and multiple-choice letters.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

WORDS = (
    "the a an and or but if then so because when while after before of to in on at by for with "
    "from about into over under between through during without within across up down out off "
    "is are was were be been being have has had do does did will would can could should may "
    "might must shall i you he she it we they me him her us them my your his its our their "
    "this that these those what which who whom whose where why how all any both each few more "
    "most other some such no not only own same than too very just also again still even now "
    "here there always never often sometimes today tomorrow yesterday time year day week month "
    "hour minute second morning evening night people person man woman child children boy girl "
    "friend family mother father sister brother teacher student class school book page word "
    "letter number problem question answer solution step result total sum difference product "
    "quotient half third quarter double twice times apple apples orange oranges banana bananas "
    "cookie cookies egg eggs cake cakes pencil pencils marble marbles ball balls box boxes "
    "bag bags car cars train trains bus ticket tickets dollar dollars cent cents price cost "
    "money store shop market farm farmer garden tree trees flower flowers dog dogs cat cats bird "
    "birds fish water milk bread cup cups glass bottle bottles house room door window table "
    "chair bed city town road street mile miles meter meters kilometer hour hours speed distance "
    "each every per left right first second third last next new old big small long short high "
    "low good bad great little many much few several equal more less fewer greater smaller "
    "buy buys bought sell sells sold give gives gave take takes took make makes made get gets "
    "got find finds found have has keep keeps kept spend spends spent save saves saved earn "
    "earns earned pay pays paid read reads write writes wrote run runs ran walk walks walked "
    "eat eats ate drink drinks drank bake bakes baked plant plants planted share shares shared "
    "split splits count counts counted add adds added subtract multiply divide divides think "
    "know knows knew say says said tell tells told ask asks asked use uses used need needs want "
    "wants like likes look looks see sees saw come comes came go goes went work works worked "
    "play plays played help helps helped try tries tried call calls called start starts end "
    "correct incorrect true false yes no maybe please thank thanks hello hi sure okay let us "
    "solve check verify compute calculate reason explain because therefore thus hence so "
    "final answer format boxed choose choice option options select best following statement "
    "function tool tools call calls argument arguments name value result error weather "
    "temperature location search query calculator expression unit units celsius fahrenheit "
    "assistant user system helpful careful honest short clear concise math reasoning story "
    "altogether remaining remains rest together percent percentage rate profit discount "
    "earnings salary weekly daily monthly yearly average twice thrice dozen dozens pair pairs "
    "clip clips sticker stickers card cards toy toys page pages candy candies pie pies slice "
    "slices pizza pizzas shirt shirts shoe shoes sock socks job jobs game games team teams "
    "January February March April May June July August September October November December "
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday "
    "Alice Bob Carol Dave Emma Frank Grace Henry Ivy Jack Kate Liam Mia Noah Olivia Paul "
    "Quinn Rosa Sam Tom Uma Victor Wendy Xavier Yara Zoe"
).split()

NAMES = [w for w in WORDS if w[0].isupper()]
ITEMS = [
    ("apple", "apples"),
    ("orange", "oranges"),
    ("cookie", "cookies"),
    ("pencil", "pencils"),
    ("marble", "marbles"),
    ("book", "books"),
    ("egg", "eggs"),
    ("ticket", "tickets"),
    ("flower", "flowers"),
    ("bottle", "bottles"),
    ("ball", "balls"),
    ("cake", "cakes"),
]
OPS = [
    ("+", "plus", lambda a, b: a + b),
    ("-", "minus", lambda a, b: a - b),
    ("*", "times", lambda a, b: a * b),
    ("/", "divided by", None),
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful math tutor. Think step by step and put the final answer in \\boxed{}.",
    "You are a deep thinking AI. You may use extremely long chains of thought to deeply consider "
    "the problem. Enclose your thoughts inside <think> </think> tags, then give the answer.",
    "Answer with a single letter.",
    "You are a function calling AI model. Use the tools when they help.",
]


def _sentence(rng: random.Random) -> str:
    n = rng.randint(4, 14)
    words = [rng.choice(WORDS) for _ in range(n)]
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!", ","])


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    """Return (question, reasoning, answer) for a small arithmetic problem."""
    sym, word, fn = rng.choice(OPS)
    a, b = rng.randint(0, 999), rng.randint(1, 99)
    if fn is None:
        a = a * b
        result = a // b
    else:
        result = fn(a, b)
    style = rng.randint(0, 3)
    if style == 0:
        question = f"What is {a} {sym} {b}?"
    elif style == 1:
        question = f"Compute {a} {word} {b}."
    elif style == 2:
        question = f"Calculate: {a} {sym} {b} = ?"
    else:
        question = f"{a} {sym} {b}"
    reasoning = f"{a} {sym} {b} = {result}"
    return question, reasoning, str(result)


def _word_problem(rng: random.Random) -> tuple[str, str, str]:
    name, other = rng.sample(NAMES, 2)
    single, plural = rng.choice(ITEMS)
    a, b, price = rng.randint(2, 60), rng.randint(1, 30), rng.randint(1, 12)
    kind = rng.randint(0, 2)
    if kind == 0:
        q = (
            f"{name} has {a} {plural}. {other} gives {name} {b} more {plural}. "
            f"How many {plural} does {name} have now?"
        )
        r = f"{name} starts with {a} {plural} and gets {b} more, so {a} + {b} = {a + b}."
        ans = a + b
    elif kind == 1:
        q = (
            f"Each {single} costs ${price}. {name} buys {a} {plural}. "
            f"How much money does {name} spend?"
        )
        r = f"{a} {plural} at ${price} each cost {a} * {price} = {a * price} dollars."
        ans = a * price
    else:
        total = a * b
        q = (
            f"{name} shares {total} {plural} equally among {b} friends. "
            f"How many {plural} does each friend get?"
        )
        r = f"Each friend gets {total} / {b} = {a} {plural}."
        ans = a
    return q, r, str(ans)


def _multiple_choice(rng: random.Random) -> tuple[str, str]:
    q, _, ans = _arithmetic(rng)
    letters = ["A", "B", "C", "D"]
    correct = rng.randrange(4)
    options = []
    for i, letter in enumerate(letters):
        value = ans if i == correct else str(int(ans) + rng.choice([-3, -2, -1, 1, 2, 5, 10]))
        options.append(f"{letter}) {value}")
    body = q + "\n" + "\n".join(options) + "\nAnswer with the letter of the correct option."
    return body, letters[correct]


def _tool_call(rng: random.Random) -> tuple[dict, str]:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "expression": {"type": "string", "description": "The expression."}
                    },
                    "required": ["expression"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather for a city.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["location"],
                },
            },
        },
    ]
    tool = rng.choice(tools)
    if tool["function"]["name"] == "calculator":
        _, reasoning, _ = _arithmetic(rng)
        args = {"expression": reasoning.split(" = ")[0]}
    else:
        args = {
            "location": rng.choice(["Paris", "London", "Tokyo", "Berlin", "Cairo", "Lima"]),
            "unit": rng.choice(["celsius", "fahrenheit"]),
        }
    call = json.dumps({"name": tool["function"]["name"], "arguments": args})
    return tool, call


def _chatml(messages: list[tuple[str, str]]) -> str:
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)


def generate_documents(seed: int = 0, n: int = 40000) -> Iterator[str]:
    """Yield ``n`` deterministic training documents for the tokenizer."""
    rng = random.Random(seed)
    for _ in range(n):
        kind = rng.randint(0, 7)
        if kind == 0:
            yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 5)))
        elif kind in (1, 2):
            q, r, a = _word_problem(rng) if kind == 1 else _arithmetic(rng)
            think = f"<think>\n{r}\n</think>\n" if rng.random() < 0.5 else ""
            final = rng.choice([f"\\boxed{{{a}}}", f"The answer is \\boxed{{{a}}}.", f"#### {a}"])
            yield _chatml(
                [
                    ("system", rng.choice(SYSTEM_PROMPTS)),
                    ("user", q),
                    ("assistant", f"{think}{r} {final}"),
                ]
            )
        elif kind == 3:
            q, r, a = _word_problem(rng)
            yield f"Question: {q}\nAnswer: {r}\n#### {a}"
        elif kind == 4:
            body, letter = _multiple_choice(rng)
            yield _chatml(
                [
                    ("user", body),
                    (
                        "assistant",
                        rng.choice(
                            [
                                letter,
                                f"({letter})",
                                f"The answer is {letter}.",
                                f"\\boxed{{{letter}}}",
                            ]
                        ),
                    ),
                ]
            )
        elif kind == 5:
            tool, call = _tool_call(rng)
            yield (
                _chatml(
                    [
                        ("system", "# Tools\n<tools>\n" + json.dumps(tool) + "\n</tools>"),
                        ("user", _sentence(rng)),
                    ]
                )
                + f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
                + _chatml(
                    [
                        (
                            "tool",
                            '<tool_response>\n{"result": '
                            + str(rng.randint(-50, 999))
                            + "}\n</tool_response>",
                        )
                    ]
                )
            )
        elif kind == 6:
            a, b = rng.randint(0, 10**6), rng.randint(0, 10**4)
            yield (
                f"{a} + {b} = {a + b}; {a} - {b} = {a - b}; {a % 97} * {b % 97} = "
                f"{(a % 97) * (b % 97)}; x^2 + {b % 10}x = 0; 3.14 ({a % 100}%) [{b}] <= >= != =="
            )
        else:
            yield _chatml([("user", _sentence(rng)), ("assistant", _sentence(rng))])
