"""``eval_runner`` as the original's eval files call it: ``asyncio.run(eval_runner(MyEval()))``
with ``--server-url``/``--model-name``, run as a script against a real server process: the
metrics line is printed and the metrics dict returned; ``--eval-dir`` gets the files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from tests.envs.serve_helpers import fake_server_cmd

EVAL_FILE = textwrap.dedent(
    """
    import asyncio, json, sys
    from atroposlib.envs.eval import EvalBase, eval_runner

    class Echo(EvalBase):
        def setup_data(self):
            return [{"q": "2+2"}, {"q": "3+3"}]

        async def run_item(self, server, data_item):
            out = await self.chat_completion(server, [{"role": "user", "content": data_item["q"]}])
            return {"answered": float(bool(out.choices[0].message.content))}, [
                {"question": data_item["q"]}
            ]

    if __name__ == "__main__":
        echo = Echo(max_tokens=4)
        metrics = asyncio.run(eval_runner(echo))
        print(json.dumps({"metrics": metrics, "samples": echo.eval_samples}))
    """
)


def test_an_eval_file_written_for_the_original_runs(tmp_path):
    port = free_port()
    script = tmp_path / "my_eval.py"
    script.write_text(EVAL_FILE)
    with running_process(
        fake_server_cmd(port, latency_ms=0), health_url=f"http://127.0.0.1:{port}/health"
    ):
        proc = subprocess.run(
            [
                sys.executable,
                str(script),
                "--server-url",
                f"http://127.0.0.1:{port}/v1",
                "--model-name",
                "fake",
                "--eval-dir",
                str(tmp_path / "out"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr
    *_, printed, last = proc.stdout.strip().splitlines()
    result = json.loads(last)
    assert result["metrics"] == {"answered": 1.0}
    assert printed == "Echo@1 metrics: {'answered': 1.0}"
    assert sorted(s["question"] for s in result["samples"]) == ["2+2", "3+3"]
    record = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert record["config_general"]["model_name"] == "fake"
