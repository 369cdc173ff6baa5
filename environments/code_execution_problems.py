"""The coding environment's own problem set, generated offline: no dataset is downloaded.

Each problem has a statement, a kind (``func``: LeetCode-style ``class Solution`` with a
method called on arguments; ``stdin_stdout``: a program reading stdin and printing the
answer), a reference solution, and tests made from seeded random inputs whose expected
outputs come from a trusted Python function here, never from running model code. Items
have the original's fields: ``problem``, ``problem_type``, ``starter_code``, ``fn_name``,
``tests`` (``{"input": [...], "output": [...]}``; a ``func`` test's input is one JSON value
per argument per line and its output one JSON value, as in LiveCodeBench), ``difficulty``.

Example::

    train, test = problem_set()          # the same items on every machine
    python environments/code_execution_problems.py --out problems.jsonl   # as jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable, Dict, List, Sequence, Tuple

__all__ = ["EVAL_NAMES", "PROBLEMS", "ProblemSpec", "make_item", "problem_set"]

SEED = 20261202
TESTS_PER_PROBLEM = 6


@dataclass(frozen=True)
class ProblemSpec:
    """One problem: how to make its inputs, the trusted answer, and a reference solution."""

    name: str
    difficulty: str
    kind: str  # "func" or "stdin_stdout"
    statement: str
    make_input: Callable[[random.Random], Any]  # func: the argument list; stdin: the stdin text
    answer: Callable[[Any], Any]  # func: the return value; stdin: the expected stdout
    solution: str
    fn_name: str = "none"
    starter_code: str = ""


def _ints(rng: random.Random, n: int, lo: int = -50, hi: int = 50) -> List[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _word(rng: random.Random, lo: int = 1, hi: int = 8, alphabet: str = "abcde") -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _kadane(nums: List[int]) -> int:
    best = cur = nums[0]
    for x in nums[1:]:
        cur = max(x, cur + x)
        best = max(best, cur)
    return best


def _lis(nums: List[int]) -> int:
    tails: List[int] = []
    for x in nums:
        lo, hi = 0, len(tails)
        while lo < hi:
            mid = (lo + hi) // 2
            if tails[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        tails[lo : lo + 1] = [x]
    return len(tails)


def _prefix(words: List[str]) -> str:
    out = ""
    for chars in zip(*words, strict=False):
        if len(set(chars)) != 1:
            break
        out += chars[0]
    return out


def _primes(n: int) -> List[int]:
    return [p for p in range(2, n + 1) if all(p % d for d in range(2, math.isqrt(p) + 1))]


def _inversions(nums: List[int]) -> int:
    return sum(1 for i in range(len(nums)) for j in range(i + 1, len(nums)) if nums[i] > nums[j])


def _parse_ints(text: str) -> List[int]:
    return [int(t) for t in text.split()]


def _func(name: str, signature: str) -> str:
    return f"class Solution:\n    def {name}(self, {signature}):\n        "


PROBLEMS: Tuple[ProblemSpec, ...] = (
    ProblemSpec(
        "sum_of_squares",
        "easy",
        "func",
        "Given a list of integers nums, return the sum of the squares of its elements.",
        lambda r: [_ints(r, r.randint(0, 8))],
        lambda a: sum(x * x for x in a[0]),
        "class Solution:\n    def sumOfSquares(self, nums):\n        return sum(x * x for x in nums)\n",
        "sumOfSquares",
        _func("sumOfSquares", "nums: List[int]) -> int:"),
    ),
    ProblemSpec(
        "reverse_words",
        "easy",
        "func",
        "Given a string s of words separated by single spaces, return the words in reverse "
        "order, separated by single spaces.",
        lambda r: [" ".join(_word(r) for _ in range(r.randint(1, 6)))],
        lambda a: " ".join(reversed(a[0].split(" "))),
        "class Solution:\n    def reverseWords(self, s):\n        return ' '.join(s.split(' ')[::-1])\n",
        "reverseWords",
        _func("reverseWords", "s: str) -> str:"),
    ),
    ProblemSpec(
        "count_vowels",
        "easy",
        "func",
        "Return how many characters of the lowercase string s are vowels (a, e, i, o, u).",
        lambda r: [_word(r, 0, 12, "aeioubcdxyz")],
        lambda a: sum(c in "aeiou" for c in a[0]),
        "class Solution:\n    def countVowels(self, s):\n        return sum(c in 'aeiou' for c in s)\n",
        "countVowels",
        _func("countVowels", "s: str) -> int:"),
    ),
    ProblemSpec(
        "fibonacci",
        "easy",
        "func",
        "Return the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1 (0 <= n <= 80).",
        lambda r: [r.randint(0, 80)],
        lambda a: _fib(a[0]),
        "class Solution:\n    def fib(self, n):\n        a, b = 0, 1\n        for _ in range(n):\n"
        "            a, b = b, a + b\n        return a\n",
        "fib",
        _func("fib", "n: int) -> int:"),
    ),
    ProblemSpec(
        "longest_common_prefix",
        "easy",
        "func",
        "Return the longest common prefix of the non-empty list of strings words.",
        lambda r: [[w + _word(r, 0, 3) for w in [_word(r, 0, 3)] * r.randint(1, 4)]],
        lambda a: _prefix(a[0]),
        "import os\nclass Solution:\n    def longestCommonPrefix(self, words):\n"
        "        return os.path.commonprefix(words)\n",
        "longestCommonPrefix",
        _func("longestCommonPrefix", "words: List[str]) -> str:"),
    ),
    ProblemSpec(
        "max_subarray",
        "medium",
        "func",
        "Given a non-empty list of integers nums, return the largest sum of a contiguous, "
        "non-empty sub-array.",
        lambda r: [_ints(r, r.randint(1, 12))],
        lambda a: _kadane(a[0]),
        "class Solution:\n    def maxSubArray(self, nums):\n        best = cur = nums[0]\n"
        "        for x in nums[1:]:\n            cur = max(x, cur + x)\n            best = max(best, cur)\n"
        "        return best\n",
        "maxSubArray",
        _func("maxSubArray", "nums: List[int]) -> int:"),
    ),
    ProblemSpec(
        "unique_paths",
        "medium",
        "func",
        "A robot on an m x n grid starts at the top-left corner and moves only right or down. "
        "Return the number of distinct paths to the bottom-right corner.",
        lambda r: [r.randint(1, 12), r.randint(1, 12)],
        lambda a: math.comb(a[0] + a[1] - 2, a[0] - 1),
        "import math\nclass Solution:\n    def uniquePaths(self, m, n):\n"
        "        return math.comb(m + n - 2, m - 1)\n",
        "uniquePaths",
        _func("uniquePaths", "m: int, n: int) -> int:"),
    ),
    ProblemSpec(
        "longest_increasing_subsequence",
        "hard",
        "func",
        "Return the length of the longest strictly increasing subsequence of nums.",
        lambda r: [_ints(r, r.randint(0, 15), 0, 20)],
        lambda a: _lis(a[0]),
        "import bisect\nclass Solution:\n    def lengthOfLIS(self, nums):\n        tails = []\n"
        "        for x in nums:\n            i = bisect.bisect_left(tails, x)\n"
        "            tails[i:i + 1] = [x]\n        return len(tails)\n",
        "lengthOfLIS",
        _func("lengthOfLIS", "nums: List[int]) -> int:"),
    ),
    ProblemSpec(
        "sum_pairs",
        "easy",
        "stdin_stdout",
        "The first line holds t. Each of the next t lines holds two integers a and b; print "
        "a + b on its own line for each.",
        lambda r: _lines(
            [[r.randint(-1000, 1000), r.randint(-1000, 1000)] for _ in range(r.randint(1, 5))]
        ),
        lambda text: "\n".join(str(a + b) for a, b in _pairs(text)) + "\n",
        "t = int(input())\nfor _ in range(t):\n    a, b = map(int, input().split())\n    print(a + b)\n",
    ),
    ProblemSpec(
        "min_max",
        "easy",
        "stdin_stdout",
        "The first line holds n, the second n integers. Print the smallest and the largest, "
        "separated by a space.",
        lambda r: _counted(_ints(r, r.randint(1, 10))),
        lambda text: f"{min(_parse_ints(text)[1:])} {max(_parse_ints(text)[1:])}\n",
        "input()\nnums = list(map(int, input().split()))\nprint(min(nums), max(nums))\n",
    ),
    ProblemSpec(
        "gcd",
        "easy",
        "stdin_stdout",
        "Read two positive integers a and b from one line and print their greatest common divisor.",
        lambda r: f"{r.randint(1, 10**6)} {r.randint(1, 10**6)}\n",
        lambda text: f"{math.gcd(*_parse_ints(text))}\n",
        "import math\na, b = map(int, input().split())\nprint(math.gcd(a, b))\n",
    ),
    ProblemSpec(
        "sorted_unique",
        "easy",
        "stdin_stdout",
        "The first line holds n, the second n integers. Print the distinct values in increasing "
        "order, separated by spaces.",
        lambda r: _counted(_ints(r, r.randint(1, 12), 0, 9)),
        lambda text: " ".join(map(str, sorted(set(_parse_ints(text)[1:])))) + "\n",
        "input()\nprint(*sorted(set(map(int, input().split()))))\n",
    ),
    ProblemSpec(
        "primes_up_to",
        "medium",
        "stdin_stdout",
        "Read n (2 <= n <= 500) and print every prime p <= n in increasing order, separated "
        "by spaces.",
        lambda r: f"{r.randint(2, 500)}\n",
        lambda text: " ".join(map(str, _primes(int(text)))) + "\n",
        "n = int(input())\nsieve = [True] * (n + 1)\nout = []\nfor p in range(2, n + 1):\n"
        "    if sieve[p]:\n        out.append(p)\n        for q in range(p * p, n + 1, p):\n"
        "            sieve[q] = False\nprint(*out)\n",
    ),
    ProblemSpec(
        "prefix_sums",
        "medium",
        "stdin_stdout",
        "The first line holds n, the second n integers. Print the n prefix sums, one per line.",
        lambda r: _counted(_ints(r, r.randint(1, 8))),
        lambda text: "".join(f"{s}\n" for s in accumulate(_parse_ints(text)[1:])),
        "import sys\ndata = sys.stdin.read().split()\ntotal = 0\nfor x in data[1:]:\n"
        "    total += int(x)\n    print(total)\n",
    ),
    ProblemSpec(
        "inversions",
        "hard",
        "stdin_stdout",
        "The first line holds n, the second n integers. Print the number of pairs i < j with "
        "a[i] > a[j].",
        lambda r: _counted(_ints(r, r.randint(1, 12), 0, 9)),
        lambda text: f"{_inversions(_parse_ints(text)[1:])}\n",
        "import sys\na = list(map(int, sys.stdin.read().split()))[1:]\n"
        "print(sum(a[i] > a[j] for i in range(len(a)) for j in range(i + 1, len(a))))\n",
    ),
)

EVAL_NAMES = ("max_subarray", "fibonacci", "gcd", "prefix_sums")
"""Problems held out for evaluation (never trained on): two of each kind."""


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _lines(rows: Sequence[Sequence[int]]) -> str:
    return f"{len(rows)}\n" + "".join(" ".join(map(str, row)) + "\n" for row in rows)


def _pairs(text: str) -> List[Tuple[int, int]]:
    nums = _parse_ints(text)[1:]
    return list(zip(nums[::2], nums[1::2], strict=False))


def _counted(nums: Sequence[int]) -> str:
    return f"{len(nums)}\n{' '.join(map(str, nums))}\n"


def make_item(
    spec: ProblemSpec, idx: int, split: str, n_tests: int = TESTS_PER_PROBLEM
) -> Dict[str, Any]:
    """The item of ``spec`` in the original's shape, tests from a seed fixed per problem."""
    rng = random.Random(f"{SEED}:{spec.name}")
    inputs, outputs = [], []
    for _ in range(n_tests):
        value = spec.make_input(rng)
        if spec.kind == "func":
            inputs.append("\n".join(json.dumps(arg) for arg in value))
            outputs.append(json.dumps(spec.answer(value)))
        else:
            inputs.append(value)
            outputs.append(spec.answer(value))
    return {
        "idx": idx,
        "split": split,
        "name": spec.name,
        "problem": spec.statement,
        "problem_type": spec.kind,
        "starter_code": spec.starter_code,
        "fn_name": spec.fn_name,
        "difficulty": spec.difficulty,
        "tests": {"input": inputs, "output": outputs},
        "solution": spec.solution,
    }


def problem_set(
    n_tests: int = TESTS_PER_PROBLEM,
) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """``(train, test)`` items: the same on every machine (fixed seeds)."""
    train = [s for s in PROBLEMS if s.name not in EVAL_NAMES]
    test = [s for s in PROBLEMS if s.name in EVAL_NAMES]
    return (
        [make_item(s, i, "train", n_tests) for i, s in enumerate(train)],
        [make_item(s, i, "test", n_tests) for i, s in enumerate(test)],
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Write the problem set as jsonl (``--split train|test|all``)."""
    parser = argparse.ArgumentParser(description="Write the coding problem set as jsonl.")
    parser.add_argument("--out", required=True, help="Output jsonl path.")
    parser.add_argument("--split", choices=("train", "test", "all"), default="all")
    args = parser.parse_args(argv)
    train, test = problem_set()
    rows = {"train": train, "test": test, "all": train + test}[args.split]
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
