"""Scoring model-written code against tests: in the bubblewrap sandbox, or on Modal.

A completion's last fenced code block runs once per completion in a fresh sandbox, with a
small harness beside it: for ``stdin_stdout`` problems the harness runs the program once
per test with that test's stdin (a real process, with a per-test time limit); for ``func``
problems it loads the code and calls the method on each test's arguments. As in the
original, the first error or time-out ends the run (the remaining tests count as failed). The harness
reports only what the code produced; the expected outputs never enter the sandbox and the
comparison happens here, so code that tampers with the harness can at most report wrong
answers for itself.

Example::

    executor = SandboxExecutor(Sandbox(), per_test_timeout_s=4)
    report = await executor.run(code, item)      # item: problem_type, fn_name, tests
    report.all_passed, report.detail
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Dict, List, Protocol, Sequence

from atroposlib.sandbox import EndReason, Sandbox

__all__ = [
    "HARNESS",
    "ModalExecutor",
    "SandboxExecutor",
    "TestReport",
    "extract_python_code_blocks",
    "outputs_match",
    "values_match",
]

_CODE_BLOCK = re.compile(r"^```(?:\w+)?\s*\n(.*?)(?=^```)```", re.DOTALL | re.MULTILINE)
_MARK = "\x00ATROPOS-RESULTS\x00"
_STARTUP_S = 2.0  # the harness's own start, on top of the tests' time limits
_FLOAT_TOL = Decimal("1e-4")


def extract_python_code_blocks(text: str) -> List[str]:
    """Every fenced code block of ``text`` (```` ```python ```` or bare), in order."""
    return _CODE_BLOCK.findall(text)


@dataclass
class TestReport:
    """The outcome of one completion's code on one problem's tests."""

    passed: List[bool]
    detail: str = ""
    reason: str = ""  # the sandbox's EndReason value, or "modal"
    results: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def all_passed(self) -> bool:
        """True when there were tests and the code passed every one."""
        return bool(self.passed) and all(self.passed)


class Executor(Protocol):
    """Runs code against an item's tests."""

    async def run(self, code: str, item: Dict[str, Any]) -> TestReport: ...


HARNESS = r"""
import io, json, signal, subprocess, sys

MARK = "\x00ATROPOS-RESULTS\x00"
PRELUDE = (
    "from typing import *\nimport collections, math, heapq, bisect, itertools, functools\n"
    "import re, string\n"
)


def run_stdio(job):
    out = []
    for text in job["inputs"]:
        try:
            done = subprocess.run(
                [sys.executable, "solution.py"], input=text.encode(), capture_output=True,
                timeout=job["timeout"],
            )
        except subprocess.TimeoutExpired:
            out.append({"timeout": True})
            break
        out.append({
            "stdout": done.stdout[: job["keep"]].decode("utf-8", "replace"),
            "stderr": done.stderr[-2000:].decode("utf-8", "replace"),
            "returncode": done.returncode,
        })
        if done.returncode != 0:
            break
    return out + [{"skipped": True}] * (len(job["inputs"]) - len(out))


def on_alarm(*_):
    raise TimeoutError("time limit exceeded")


def run_func(job):
    ns = {"__name__": "solution"}
    try:
        with open("solution.py") as f:
            exec(compile(PRELUDE + f.read(), "solution.py", "exec"), ns)
        owner = ns["Solution"]() if "Solution" in ns else None
        fn = getattr(owner, job["fn_name"]) if owner is not None else ns[job["fn_name"]]
    except BaseException as e:
        return [{"error": (type(e).__name__ + ": " + str(e))[:2000]}] * len(job["inputs"])
    signal.signal(signal.SIGALRM, on_alarm)
    out = []
    for text in job["inputs"]:
        sys.stdout = io.StringIO()  # what the solution prints is not its answer
        try:
            args = [json.loads(line) for line in text.split("\n")]
            signal.setitimer(signal.ITIMER_REAL, job["timeout"])
            value = fn(*args)
            signal.setitimer(signal.ITIMER_REAL, 0)
            if isinstance(value, tuple):
                value = list(value)
            out.append({"value": json.loads(json.dumps(value))})
        except BaseException as e:
            signal.setitimer(signal.ITIMER_REAL, 0)
            out.append({
                "error": (type(e).__name__ + ": " + str(e))[:2000],
                "timeout": isinstance(e, TimeoutError),
            })
            break
        finally:
            sys.stdout = sys.__stdout__
    return out + [{"skipped": True}] * (len(job["inputs"]) - len(out))


job = json.loads(sys.stdin.read())
results = run_func(job) if job["kind"] == "func" else run_stdio(job)
sys.__stdout__.write("\n" + MARK + json.dumps(results) + "\n")
sys.__stdout__.flush()
"""
"""The harness run beside the solution in the sandbox (``/tmp/harness.py``)."""


def _number(token: str) -> Decimal | None:
    try:
        value = Decimal(token)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _lines_of(text: str) -> List[str]:
    return [line.strip() for line in text.strip().split("\n")]


def outputs_match(got: str, expected: str) -> bool:
    """Whether stdout ``got`` answers ``expected``: the same lines once stripped, where a line
    may differ in spacing, and numbers within 1e-4."""
    got_lines, want_lines = _lines_of(got), _lines_of(expected)
    if len(got_lines) != len(want_lines):
        return False
    for g, w in zip(got_lines, want_lines, strict=False):
        if g == w:
            continue
        g_tokens, w_tokens = g.split(), w.split()
        if len(g_tokens) != len(w_tokens):
            return False
        for a, b in zip(g_tokens, w_tokens, strict=False):
            if a == b:
                continue
            x, y = _number(a), _number(b)
            if x is None or y is None or abs(x - y) > _FLOAT_TOL:
                return False
    return True


def values_match(got: Any, expected: Any) -> bool:
    """Whether a function's return value equals the expected one (floats within 1e-6,
    tuples as lists, which JSON has already made them)."""
    if isinstance(got, float) or isinstance(expected, float):
        if isinstance(got, bool) or isinstance(expected, bool):
            return got == expected
        try:
            return math.isclose(float(got), float(expected), rel_tol=1e-6, abs_tol=1e-6)
        except (TypeError, ValueError):
            return False
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(map(values_match, got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_match(got[k], expected[k]) for k in got)
    return type(got) is type(expected) and got == expected


def _expected_values(outputs: Sequence[Any]) -> List[Any]:
    return [json.loads(o) if isinstance(o, str) else o for o in outputs]


class SandboxExecutor:
    """Runs each completion's code once in a fresh :class:`Sandbox`, all its tests inside."""

    def __init__(self, sandbox: Sandbox, per_test_timeout_s: float = 4.0):
        self.sandbox = sandbox
        self.per_test_timeout_s = per_test_timeout_s

    async def run(self, code: str, item: Dict[str, Any]) -> TestReport:
        """The report of ``code`` on ``item["tests"]`` (a ``func`` or ``stdin_stdout`` item)."""
        tests = item["tests"]
        inputs, outputs = list(tests["input"]), list(tests["output"])
        kind = "func" if item.get("problem_type") == "func" else "stdin_stdout"
        fn_name = item.get("fn_name") or tests.get("fn_name") or "none"
        # Each test's stdout is cut to its share of the output bound, with room for JSON's
        # escapes, so one chatty test cannot push the report past the bound.
        keep = max(1024, self.sandbox.config.max_output_bytes // (4 * max(len(inputs), 1)))
        job = {
            "kind": kind,
            "inputs": inputs,
            "fn_name": fn_name,
            "timeout": self.per_test_timeout_s,
            "keep": keep,
        }
        result = await self.sandbox.run(
            [self.sandbox.python, "harness.py"],
            stdin=json.dumps(job),
            files={"harness.py": HARNESS, "solution.py": code},
            timeout_s=self.per_test_timeout_s * max(len(inputs), 1) + _STARTUP_S,
        )
        at = result.stdout.rfind(_MARK)
        if result.reason is not EndReason.OK or at < 0:
            return TestReport(
                [False] * len(inputs), f"sandbox: {result.message}", result.reason.value
            )
        try:
            results = json.loads(result.stdout[at + len(_MARK) :])
        except ValueError:
            results = None
        if not isinstance(results, list) or len(results) != len(inputs):
            return TestReport([False] * len(inputs), "unreadable results", result.reason.value)
        if kind == "func":
            return _func_report(results, _expected_values(outputs))
        return _stdio_report(results, outputs)


def _func_report(results: List[Dict[str, Any]], expected: List[Any]) -> TestReport:
    passed, detail = [], ""
    for res, want in zip(results, expected, strict=False):
        ok = "value" in res and values_match(res["value"], want)
        passed.append(ok)
        if not ok and not detail:
            if res.get("timeout"):
                detail = "Time Limit Exceeded"
            elif "error" in res:
                detail = f"Runtime Error: {res['error']}"
            else:
                detail = "Wrong Answer"
    return TestReport(passed, detail, EndReason.OK.value, results)


def _stdio_report(results: List[Dict[str, Any]], expected: List[str]) -> TestReport:
    passed, detail = [], ""
    for res, want in zip(results, expected, strict=False):
        ok = (
            not res.get("timeout")
            and res.get("returncode") == 0
            and outputs_match(res.get("stdout", ""), want)
        )
        passed.append(ok)
        if not ok and not detail:
            if res.get("timeout"):
                detail = "Time Limit Exceeded"
            elif res.get("returncode") != 0:
                detail = f"Runtime Error: {res.get('stderr', '').strip()[-300:]}"
            else:
                detail = "Wrong Answer"
    return TestReport(passed, detail, EndReason.OK.value, results)


class ModalExecutor:
    """The original's path: the LiveCodeBench ``run_test`` function deployed on Modal.

    Needs the ``modal`` package, a Modal account and the function deployed
    (``modal deploy lcb_modal_endpoint.py`` from the original); it is looked up when the
    executor is created.
    """

    def __init__(self, app_name: str, function_name: str):
        try:
            import modal
        except ImportError as e:
            raise RuntimeError(
                "code_executor='modal' needs the modal package: `pip install modal`, then "
                "`modal token new`; or use code_executor='sandbox' (local bubblewrap)"
            ) from e
        self._run_test = modal.Function.from_name(app_name, function_name)

    async def run(self, code: str, item: Dict[str, Any]) -> TestReport:
        """``run_test({"tests": ...}, code)`` on Modal; passed where it answered ``True``."""
        tests = dict(item["tests"])
        tests["fn_name"] = item.get("fn_name") or tests.get("fn_name") or "none"
        try:
            res, metadata = await self._run_test.remote.aio({"tests": tests}, code)
        except Exception as e:  # a remote crash is a failed run, as in the original
            return TestReport([False] * len(tests["input"]), f"modal: {e}", "modal")
        passed = [r is True for r in res] or [False]
        detail = "" if all(passed) else str(metadata.get("error_message", metadata))[:300]
        return TestReport(passed, detail, "modal")
