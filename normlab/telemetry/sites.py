"""The forward side of a telemetry step: the tap that keeps the model's tensors (normlab.nn.tap), the identity that
measures the residual stream's gradient in backward, and the statistics of every site computed at once.

The statistics of one site are computed for many blocks together: the blocks' tensors stacked (in chunks of at
most STACK_ELEMENTS elements, each measured as soon as its last block has run), or reduced by one fused
multi-tensor kernel (torch._foreach_norm), so a telemetry step launches a few kernels per block (the
gradient's collector, the probed rows of queries and keys) and the rest per chunk of blocks. Everything reduces, on the device, to two flat vectors per forward: sums,
which micro-batches add up, and maxima. `Entry`s say which keys their values are; `read_entries` turns the
transferred values into the statistics on the host.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from normlab.keys import layer_key, parse
from normlab.telemetry.stats import (
    attention_stats,
    feature_kurtosis,
    head_entropy_stats,
    l2_norms,
    logz_sum,
    max_abs,
    max_median_ratios,
    token_angles,
    token_cos,
    top_median_ratios,
    units,
)

# A stack of blocks' tensors holds at most this many elements (16 MiB in float32), and so does each temporary
# of the same size that its statistics make: below the 32 MiB from which glibc maps fresh pages for a block
# (normlab.train.runtime.MMAP_THRESHOLD), so that on the CPU they come from the heap rather than page faults:
# with the medium preset's whole stream in one 36 MiB stack a telemetry step added 334-467 ms of CPU time, the
# hook-based Probe before it 170 ms. That stream (32 × 128 × 256 a block) is now stacked three blocks at a
# time. CUDA has the same cap. With 1 << 24 there (64 MiB in float32) the medium preset's stream and attention
# statistics were one chunk each, not three and two (124 fewer ops per telemetry step, counted on the CPU:
# scripts/bench/telemetry_cost.py --ops --ops-stack-elements 16777216), but the H100's eager telemetry overhead then
# measured 66% (docs/benchmarks/h100-2026-11-26-folded-attention.md) against 15% at 1 << 22
# (docs/benchmarks/h100-2026-11-26-telemetry.md), on two machines;
# until a GPU run compares the two caps on one machine (scripts/gpu/telemetry_cap.sh), CUDA keeps the one that measured better.
STACK_ELEMENTS = 1 << 22
# The attention statistics and the max/median ratio are taken on the step's first PROBE_SEQS sequences,
# however many micro-batches hold them (grad_accum cuts the batch into consecutive chunks, so they are the
# same sequences whatever its value): the explicit T×T score matrix and the per-token median are the most
# expensive statistics.
PROBE_SEQS = 8


# The statistics of the probed sequences alone: absent from a micro-batch that holds none of them.
MEDIAN_STATS = (("mean", "act/max_median"), ("max", "act/max_median_max"), ("mean", "act/top_median"),
                ("max", "act/top_median_max"))


class Collect(torch.autograd.Function):
    """x itself in the forward; in the backward, the sum of squares of x's gradient (float32) as the gradient of
    `collector`, a zero leaf: after backward `collector.grad` holds it, summed over the step's micro-batches.
    Autograd and torch.compile's backward graph run it as they run any other op; under torch.func.vmap (a pack's
    forward) BatchedCollect does the same."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, collector: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, _square_sum(grad)


class BatchedCollect(torch.autograd.Function):
    """Collect in the form torch.func.vmap takes (a separate setup_context, a generated vmap rule). Only there: torch
    binds such a function's arguments by inspect.signature at every call, which costs a telemetry step's host more
    than the op itself."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, collector: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, _square_sum(grad)


def _square_sum(grad: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(grad, dtype=torch.float32).square()


@dataclass(frozen=True)
class Plan:
    """What one forward's statistics depend on besides its tensors."""

    labels: tuple[str, ...]  # the blocks' layer labels
    rows: int  # how many leading sequences of this micro-batch are among the step's probed ones
    softcap: float | None  # the attention's logit cap
    # False under torch.func.vmap (a pack's forward): the RMS by one norm each (torch._foreach_norm has no batching
    # rule), the stream's gradient by BatchedCollect
    fused: bool = True


@dataclass(frozen=True)
class Entry:
    """A run of transferred values: `width` of them per key, combined as `kind` says over `count` terms (per
    micro-batch; the Probe adds the counts up)."""

    kind: str  # rms (a sum of squares over `count` elements), mean, max, kurtosis, entropy
    keys: tuple[str, ...]
    width: int = 1
    count: int = 0


class Parts:
    """One forward's statistics as they are transferred: the sums and the maxima, each one flat vector."""

    def __init__(self):
        self.values: dict[str, list[torch.Tensor]] = {"sum": [], "max": []}
        self.entries: dict[str, list[Entry]] = {"sum": [], "max": []}

    def add(self, kind: str, keys: tuple[str, ...], values: torch.Tensor, count: int = 0) -> None:
        where = "max" if kind == "max" else "sum"
        self.values[where].append(values if values.dim() == 1 else values.reshape(-1))
        self.entries[where].append(Entry(kind, keys, values.numel() // len(keys), count))

    def add_runs(self, kind: str, runs: tuple[tuple[tuple[str, ...], int], ...], values: torch.Tensor) -> None:
        """Several entries of one value per key from one vector: `runs` are their (keys, count), in its order."""
        where = "max" if kind == "max" else "sum"
        self.values[where].append(values)
        self.entries[where].extend(Entry(kind, keys, 1, count) for keys, count in runs)

    def absent(self, kind: str, keys: tuple[str, ...], like: torch.Tensor, width: int = 1) -> None:
        """Entries this forward does not measure (none of its sequences is probed): 0 to add, -inf to max."""
        fill = -math.inf if kind == "max" else 0.0
        self.add(kind, keys, torch.full((len(keys) * width,), fill, device=like.device), 0)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[Entry, ...], tuple[Entry, ...]]]:
        return torch.cat(self.values["sum"]), torch.cat(self.values["max"]), (*map(tuple, self.entries.values()),)


class Recorder:
    """The tap of a telemetry forward (normlab.nn.tap), and the statistics of what it is shown (`finish`).

    It keeps every tensor the model shows, by (site, block index or None), and passes the embedding
    (`collectors[0]`) and each block's output stream (`collectors[i + 1]`) through Collect. As soon as the
    last block of a chunk has run, it measures the chunk's stream statistics (and after its keys, its
    attention statistics): on the CPU their tensors are then still in the caches. `finish()` measures the
    rest and returns the forward's (sums, maxima, entries)."""

    def __init__(self, collectors: list[torch.Tensor], plan: Plan):
        self.collectors, self.plan = collectors, plan
        self.sites: dict[tuple[str, int | None], torch.Tensor] = {}
        self.parts = Parts()
        self._measured = {"out": 0, "attn.k": 0}  # blocks whose stream / attention statistics are measured

    def __call__(self, site: str, x: torch.Tensor) -> torch.Tensor:
        return self.record(site, None, x)

    def block(self, index: int) -> "BlockTap":
        return BlockTap(self, index)

    def record(self, site: str, layer: int | None, x: torch.Tensor) -> torch.Tensor:
        self.sites[site, layer] = x
        if site in self._measured and self._chunk_ends(site, layer):
            with torch.no_grad():
                self._measure(site, layer)
        if self.collectors and site in ("embed", "out"):
            collect = Collect if self.plan.fused else BatchedCollect
            return collect.apply(x, self.collectors[0 if layer is None else layer + 1])
        return x

    def _chunk_ends(self, site: str, layer: int) -> bool:
        """Whether block `layer` ends a chunk of the blocks not yet measured at `site` (out: the stream's, of
        at most STACK_ELEMENTS elements with the stream entering the first; attn.k: the attention's)."""
        x = self.sites[site, layer]
        if site == "out":
            per_chunk = max(1, STACK_ELEMENTS // x.numel() - 1)
        else:
            B, H, T, D = x.shape
            # Sized for the most rows a micro-batch can probe, not this one's: every micro-batch of a step must
            # cut its blocks into the same chunks, so that their statistics come in one order and add up key by key.
            per_chunk = max(1, STACK_ELEMENTS // (PROBE_SEQS * H * T * max(T, D)))
        return layer + 1 - self._measured[site] == per_chunk or layer == len(self.plan.labels) - 1

    def _measure(self, site: str, last: int) -> None:
        first, self._measured[site] = self._measured[site], last + 1
        blocks = range(first, last + 1)
        if site == "out":
            stream = [self.sites["in", 0] if first == 0 else self.sites["out", first - 1],
                      *(self.sites["out", i] for i in blocks)]
            _stream(self.parts, torch.stack(stream).float(), self.plan.labels[first : last + 1], self.plan.rows)
        else:
            _attention(self.parts, [self.sites["attn.q", i] for i in blocks], [self.sites["attn.k", i] for i in blocks],
                       self.plan.labels[first : last + 1], self.plan)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[Entry, ...], tuple[Entry, ...]]]:
        """The forward's statistics (the blocks' stream and attention already measured): (sums, maxima, entries)."""
        parts = self.parts
        with torch.no_grad():  # not the decorator: torch.compile cannot trace a method wrapped by it into a graph
            _rms(parts, self.sites, self.plan)
            embed = self.sites["embed", None]
            parts.add("max", ("act/embed_max",), max_abs(embed, tuple(range(embed.dim()))).reshape(1))
            logits = self.sites["logits", None]
            parts.add("mean", ("out/logz",), logz_sum(logits).reshape(1), logits.numel() // logits.size(-1))
            return parts.finish()


class BlockTap:
    """The tap block `layer` is given: its sites go to `recorder` under its index."""

    def __init__(self, recorder: Recorder, layer: int):
        self.recorder, self.layer = recorder, layer

    def __call__(self, site: str, x: torch.Tensor) -> torch.Tensor:
        return self.recorder.record(site, self.layer, x)


def eager_cached(fn):
    """`fn`, its results kept for the eager forward, which would otherwise make them again at every telemetry step
    (a run's keys and layouts recur). A compiled forward calls `fn` itself: it runs once, when Dynamo traces it
    (Dynamo would trace through a cache, not use it)."""
    cached = functools.lru_cache(maxsize=256)(fn)

    @functools.wraps(fn)
    def call(*args):
        return fn(*args) if torch.compiler.is_compiling() else cached(*args)

    return call


@eager_cached
def rms_key(site: str, label: str | None) -> str | None:
    """The RMS key of a site's tensor, or None for a site whose RMS is not logged."""
    if site == "embed":
        return "act/embed_rms"
    if site == "out":
        return layer_key("act/resid_rms", label)
    if site in ("attn.out", "mlp.out"):
        return layer_key("act/out_rms", label, site.split(".")[0])
    slot, _, end = site.rpartition(".")
    if end not in ("in", "out") or not slot:
        return None
    loc = slot.removeprefix("attn.") if label is None else f"{label}/{slot.removeprefix('attn.')}"
    return f"act/norm_{end}_rms/{loc}"


def _rms(parts: Parts, sites: dict, plan: Plan) -> None:
    """The RMS of every site that has one, by one fused norm (or one norm each under vmap)."""
    order, runs = _rms_layout(tuple(sites), plan.labels, tuple(x.numel() for x in sites.values()))
    tensors = list(sites.values())
    tensors = [tensors[i] for i in order]
    if plan.fused:
        norms = l2_norms(tensors)
    else:
        norms = torch.stack([torch.linalg.vector_norm(x, dtype=torch.float32) for x in tensors])
    parts.add_runs("rms", runs, norms.square())


@eager_cached
def _rms_layout(sites: tuple[tuple[str, int | None], ...], labels: tuple[str, ...], sizes: tuple[int, ...]
                ) -> tuple[tuple[int, ...], tuple[tuple[tuple[str, ...], int], ...]]:
    """Which of `sites` (in the order the model showed them) have an RMS, grouped by site name: their indices in
    that order, and per site name its keys and the element count of its tensors (`sizes`)."""
    by_site: dict[str, tuple[list[str], list[int]]] = {}
    for i, (site, layer) in enumerate(sites):
        key = rms_key(site, None if layer is None else labels[layer])
        if key is not None:
            keys, indices = by_site.setdefault(site, ([], []))
            keys.append(key)
            indices.append(i)
    order = tuple(i for _, indices in by_site.values() for i in indices)
    return order, tuple((tuple(keys), sizes[indices[0]]) for keys, indices in by_site.values())


@eager_cached
def layer_keys(stat: str, labels: tuple[str, ...]) -> tuple[str, ...]:
    """`stat`'s key for each of the blocks `labels`, made once per run rather than at every telemetry step."""
    return tuple(layer_key(stat, label) for label in labels)


def _stream(parts: Parts, s: torch.Tensor, labels: tuple[str, ...], rows: int) -> None:
    """The stream statistics of the blocks `labels`, from `s` (len(labels) + 1, B, T, d): the stream entering
    the first of them, then each one's output."""
    B, T, d = s.shape[1:]

    def keys(stat: str) -> tuple[str, ...]:
        return layer_keys(stat, labels)

    u = units(s)
    angles = token_angles(u[:-1], u[1:])  # (blocks, B, T): each token's angle between the block's input and output
    outs = s[1:]
    parts.add("mean", keys("act/block_angle"), angles.sum((1, 2)), B * T)
    # Gromov et al.'s and the Curse of Depth's angular distance: the sequence's last token alone.
    parts.add("mean", keys("act/block_angle_last"), angles[..., -1].sum(-1), B)
    parts.add("max", keys("act/resid_max"), max_abs(outs, (1, 2, 3)))
    # Σ_t y_tj² per feature. (A vector_norm over dims 1 and 2 would make no temporary, but takes 5x longer on the CPU.)
    parts.add("kurtosis", keys("act/kurtosis"), outs.square().sum((1, 2)))
    if T > 1:  # a pair of distinct tokens needs two
        parts.add("mean", keys("act/token_cos"), token_cos(u[1:]).sum(-1), B)
    if not rows:
        for kind, stat in MEDIAN_STATS:
            parts.absent(kind, keys(stat), s)
        return
    probed = outs[:, :rows]
    ratios = max_median_ratios(probed)  # (blocks, rows, T)
    parts.add("mean", keys("act/max_median"), ratios.sum((1, 2)), rows * T)
    parts.add("max", keys("act/max_median_max"), ratios.flatten(1).amax(-1))
    top = top_median_ratios(probed)  # (blocks, rows)
    parts.add("mean", keys("act/top_median"), top.sum(-1), rows)
    parts.add("max", keys("act/top_median_max"), top.amax(-1))


def _attention(parts: Parts, qs: list[torch.Tensor], ks: list[torch.Tensor], labels: tuple[str, ...], plan: Plan) -> None:
    """The attention statistics of the blocks `labels` from their queries and keys (B, n_head, T, head_dim), on
    the plan's rows."""
    maxima, entropies = layer_keys("attn/logit_max", labels), layer_keys("attn/entropy", labels)
    if not plan.rows:
        parts.absent("max", maxima, qs[0])
        parts.absent("entropy", entropies, qs[0], width=qs[0].size(1))
        return
    # The probed rows alone are stacked: a copy of the whole batch's would cost more than the slices' ops.
    q, k = (torch.stack([x[: plan.rows] for x in xs]) for xs in (qs, ks))
    largest, entropy = attention_stats(q, k, plan.softcap)
    parts.add("max", maxima, largest)
    parts.add("entropy", entropies, entropy, plan.rows)


def read_entries(entries: tuple[Entry, ...], counts: list[int], values: list[float]) -> dict[str, float]:
    """The statistics of `entries` from their transferred `values`, with `counts` their terms over the step."""
    stats: dict[str, float] = {}
    offset = 0
    for entry, count in zip(entries, counts):
        for key in entry.keys:
            _finish(stats, entry.kind, key, values[offset : offset + entry.width], count)
            offset += entry.width
    return stats


def _finish(stats: dict[str, float], kind: str, key: str, values: list[float], count: int) -> None:
    """Put the statistic(s) of `key` into `stats`."""
    if kind == "rms":
        stats[key] = math.sqrt(values[0] / count)
    elif kind == "mean":
        stats[key] = values[0] / count
    elif kind == "kurtosis":
        stats[key] = feature_kurtosis(values)
    elif kind == "entropy":
        stats[key], stats[_entropy_min_key(key)] = head_entropy_stats(values, count)
    else:
        stats[key] = values[0]


@functools.lru_cache(maxsize=None)  # the host names a run's keys once, not at every telemetry step
def _entropy_min_key(entropy_key: str) -> str:
    return layer_key("attn/entropy_min", parse(entropy_key).label)
