"""``GET /metrics``: the store's counters in Prometheus text exposition format."""

from __future__ import annotations

from typing import Iterable, List, Tuple

from atroposlib.api.store import RolloutStore

__all__ = ["CONTENT_TYPE", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Sample = Tuple[str, float]


def _family(name: str, kind: str, help_text: str, samples: Iterable[Sample]) -> List[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines.extend(
        f"{name}{labels} {value:g}" if isinstance(value, float) else f"{name}{labels} {value}"
        for labels, value in samples
    )
    return lines


def _env_label(env_id: object) -> str:
    return '{env_id="none"}' if env_id is None else f'{{env_id="{env_id}"}}'


def render_metrics(store: RolloutStore) -> str:
    """Render queue groups/bytes per env, ingest and batch counters, step and env counts."""
    per_env = sorted(store.queue.per_env.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
    c = store.counters
    lines: List[str] = []
    lines += _family(
        "atropos_queue_groups",
        "gauge",
        "Groups waiting on the queue, per env.",
        [(_env_label(e), s.groups) for e, s in per_env],
    )
    lines += _family(
        "atropos_queue_sequences",
        "gauge",
        "Sequences waiting on the queue, per env.",
        [(_env_label(e), s.sequences) for e, s in per_env],
    )
    lines += _family(
        "atropos_queue_bytes",
        "gauge",
        "Bytes of queued groups, per env.",
        [(_env_label(e), s.nbytes) for e, s in per_env],
    )
    buffers = [(i, store.buffer_stats(i)) for i in range(len(store.envs))]
    lines += _family(
        "atropos_buffer_groups",
        "gauge",
        "Odd-sized groups buffered, per env.",
        [(_env_label(i), b[0]) for i, b in buffers],
    )
    lines += _family(
        "atropos_buffer_sequences",
        "gauge",
        "Sequences in buffered odd-sized groups, per env.",
        [(_env_label(i), b[1]) for i, b in buffers],
    )
    lines += _family(
        "atropos_buffer_bytes",
        "gauge",
        "Bytes of buffered odd-sized groups (all envs).",
        [("", store.buffered_bytes)],
    )
    lines += _family(
        "atropos_buffer_limit_bytes",
        "gauge",
        "Bound of the buffers (--max-buffer-mb, at most half the queue budget) in bytes.",
        [("", store.max_buffer_bytes)],
    )
    lines += _family(
        "atropos_buffer_released_total",
        "counter",
        "Oldest buffered groups released onto the queue as groups of their own size (buffer full).",
        [("", c["buffer_released"])],
    )
    lines += _family(
        "atropos_buffer_dropped_total",
        "counter",
        "Buffered groups dropped, per reason (logged).",
        [('{reason="buffer_full"}', c["buffer_dropped"])],
    )
    lines += _family(
        "atropos_queue_bytes_total",
        "gauge",
        "Bytes of queued and buffered groups.",
        [("", store.queued_bytes)],
    )
    lines += _family(
        "atropos_queue_limit_bytes",
        "gauge",
        "Queue budget (--max-queue-mb) in bytes.",
        [("", store.max_queue_bytes)],
    )
    lines += _family(
        "atropos_groups_ingested_total", "counter", "Groups accepted.", [("", c["groups_ingested"])]
    )
    lines += _family(
        "atropos_sequences_ingested_total",
        "counter",
        "Sequences accepted.",
        [("", c["sequences_ingested"])],
    )
    lines += _family(
        "atropos_batches_served_total",
        "counter",
        "Batches served by /batch.",
        [("", c["batches_served"])],
    )
    lines += _family(
        "atropos_sequences_served_total",
        "counter",
        "Sequences served by /batch.",
        [("", c["sequences_served"])],
    )
    lines += _family(
        "atropos_rejected_total",
        "counter",
        "Posts rejected, per reason.",
        [
            ('{reason="queue_full"}', c["rejected_queue_full"]),
            ('{reason="invalid"}', c["rejected_invalid"]),
            ('{reason="unknown_env"}', c["rejected_unknown_env"]),
        ],
    )
    lines += _family(
        "atropos_inconsistent_groups_total",
        "counter",
        "Groups accepted although this per-token field's lengths differ from tokens "
        "(rejected instead with run-api --strict-groups).",
        [
            (f'{{field="{name}"}}', c.get(f"inconsistent_{name}", 0))
            for name in ("advantages", "ref_logprobs", "inference_logprobs")
        ],
    )
    lines += _family(
        "atropos_stale_groups_dropped_total",
        "counter",
        "Groups dropped for being more than --max-staleness versions behind, per env.",
        [
            (_env_label(e), n)
            for e, n in sorted(
                store.staleness.dropped.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)
            )
        ]
        or [("", 0)],
    )
    lines += _family(
        "atropos_internal_errors_total",
        "counter",
        "Requests that failed inside the server (logged with a traceback).",
        [("", c["internal_errors"])],
    )
    lines += _family(
        "atropos_batches_resent_total",
        "counter",
        "Unacknowledged batches served again (not received, or after a restart).",
        [("", c["batches_resent"])],
    )
    lines += _family(
        "atropos_batches_acknowledged_total",
        "counter",
        "Batches acknowledged (consumed) by the trainer.",
        [("", c["batches_acknowledged"])],
    )
    lines += _family(
        "atropos_unacknowledged_batch_groups",
        "gauge",
        "Groups of the served batch awaiting acknowledgement.",
        [("", len(store.pending.groups) if store.pending else 0)],
    )
    lines += _family(
        "atropos_envs_inactive",
        "gauge",
        "Connected envs silent for longer than --env-timeout (not counted for min_batch_allocation).",
        [("", len(store.inactive_envs()))],
    )
    lines += _family(
        "atropos_step", "gauge", "Trainer step counter (batches served).", [("", store.step)]
    )
    lines += _family(
        "atropos_envs_registered", "gauge", "Environments registered.", [("", len(store.envs))]
    )
    lines += _family(
        "atropos_envs_connected",
        "gauge",
        "Environments connected.",
        [("", sum(1 for e in store.envs if e.connected))],
    )
    return "\n".join(lines) + "\n"
