"""Policy versions: backends read them from answers, ManagedServer nodes and groups carry them."""

from __future__ import annotations

import pytest

from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.policy_version import (
    TokensResult,
    join_results,
    recording_versions,
    stamp_group,
    version_from_response,
)
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager


def _cfg(server, **kw) -> APIServerConfig:
    return APIServerConfig(base_url=server.base_url, model_name="fake", timeout=10, **kw)


class ByteTokenizer:
    """The fake server's byte-level tokens, for ManagedServer."""

    eos_token = None

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def test_version_from_response_prefers_header_then_body_fields():
    assert version_from_response({"version": 2}, {"X-Atropos-Policy-Version": "5"}) == 5
    assert version_from_response({"version": 2}) == 2
    assert version_from_response({"policy_version": 4, "version": 2}) == 4
    assert version_from_response([{"meta_info": {"weight_version": "9"}}]) == 9
    assert version_from_response({"text": ["x"]}) is None
    assert version_from_response({"version": True}) is None


def test_stamp_group_fills_min_and_max_only_when_missing():
    group = {"tokens": [[1], [2]], "masks": [[1], [2]], "scores": [0, 1]}
    stamp_group(group, [3, 5, 4])
    assert group["policy_version"] == [3, 3] and group["policy_version_max"] == [5, 5]
    same = {"tokens": [[1]], "masks": [[1]], "scores": [0]}
    stamp_group(same, [2, 2])
    assert same["policy_version"] == [2] and "policy_version_max" not in same
    own = {"tokens": [[1]], "policy_version": [7]}
    stamp_group(own, [1])
    assert own["policy_version"] == [7]


def test_split_results_keep_each_outputs_version():
    a = TokensResult(([1], [[5]], [[-0.1]], ["stop"]), 3)
    b = TokensResult(([1], [[6], [7]], [[-0.2], [-0.3]], ["stop", "length"]), 4)
    joined = join_results([a, b])
    prompt, outs, _, finish = joined
    assert outs == [[5], [6], [7]] and finish == ["stop", "stop", "length"]
    assert joined.policy_version == 3 and joined.sequence_versions == [3, 4, 4]


@pytest.mark.parametrize("where", ["body", "header"])
async def test_vllm_backend_reads_the_version_from_body_or_header(fake_pool, where):
    srv = fake_pool[0]
    srv.configure(policy_version=6, policy_version_in=where)
    manager = ServerManager([_cfg(srv, server_type="vllm")])
    try:
        with recording_versions() as seen:
            result = await manager.tokens_and_logprobs_completion(
                input_ids=[10, 11], n=2, max_tokens=4
            )
        assert result.policy_version == 6 and seen == [6]
        assert manager.servers[0].policy_version == 6
    finally:
        srv.configure(policy_version=None, policy_version_in="body")
        await manager.close()


async def test_sglang_backend_reads_meta_info_weight_version(fake_pool):
    srv = fake_pool[1]
    srv.configure(policy_version=11)
    manager = ServerManager([_cfg(srv, server_type="sglang")])
    try:
        result = await manager.tokens_and_logprobs_completion(input_ids=[1, 2], max_tokens=3)
        assert result.policy_version == 11
    finally:
        srv.configure(policy_version=None)
        await manager.close()


async def test_silent_server_uses_the_version_the_trainer_reported(fake_pool):
    srv = fake_pool[2]
    manager = ServerManager([_cfg(srv, server_type="vllm")])
    try:
        first = await manager.tokens_and_logprobs_completion(input_ids=[3, 4], max_tokens=3)
        assert first.policy_version is None
        manager.note_weights_update(8)
        after = await manager.tokens_and_logprobs_completion(input_ids=[3, 4], max_tokens=3)
        assert after.policy_version == 8
        with recording_versions() as seen:
            await manager.chat_completion(messages=[{"role": "user", "content": "hi"}])
        assert seen == [8]
    finally:
        await manager.close()


async def test_managed_nodes_record_min_and_max_across_a_weight_swap(fake_pool):
    srv = fake_pool[0]
    manager = ServerManager([_cfg(srv, server_type="vllm")])
    try:
        srv.configure(policy_version=1)
        managed = ManagedServer(manager.servers[0], tokenizer=ByteTokenizer())
        await managed.completion(prompt="turn one:", max_tokens=4)
        node = managed.get_state()["nodes"][0]
        assert (node.policy_version, node.policy_version_max) == (1, 1)
        srv.configure(policy_version=2)
        await managed.completion(prompt=node.full_text + " turn two:", max_tokens=4)
        nodes = managed.get_state()["nodes"]
        assert len(nodes) == 1
        assert (nodes[0].policy_version, nodes[0].policy_version_max) == (1, 2)
    finally:
        srv.configure(policy_version=None)
        await manager.close()
