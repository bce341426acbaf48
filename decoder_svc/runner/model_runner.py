"""ModelRunner: owns execution on the device.

It holds the model, the KV cache, persistent device input buffers with pinned host staging, the decode
CUDA graphs and the sampler. Each step it turns a ModelInput (plain lists from the engine) into device
tensors with one asynchronous copy (two when images are fused), fuses the image rows, runs the model
(replaying a graph when the step is plain decode) and samples, with one host synchronisation (the
sampled ids). `launch` returns before that synchronisation, so the engine can prepare and launch the
next step while this one runs; a token of the next step that this one samples (PENDING_TOKEN) is copied
from its output on the device.

Image rows must be memory the decoder owns (the remote source copies embeddings out of the encoder's
arena before handing them over): a step may still be reading them after execute() returns, and the
caching allocator orders their reuse behind that work on the stream.

A model with LoRA adapters runs each step one of three ways, from its rows' adapter slots: the base
model (no row has one), the per-row LoRA product, or the merged weights of the adapter made at load
(model/lora/merged.py) when every row runs that one; each way has its own CUDA graphs.

A hybrid stack's linear-attention layers keep their state in a pool of slots beside the KV cache
(model/linear_state.py), one per running request (SequenceInput.state_slot, handed out by the engine's
KV cache manager). Its plain decode steps replay graphs whose state slots are an input buffer
(`state_slots`, one per sequence row; a graph's pad rows use a slot of their own that no request holds,
`pad_state_slot`). Where its linear layers have the in-place kernels, its other small steps (every
sequence short, taking at most one snapshot: a warm request's new tokens, a follow-up question, a short
prompt, decodes beside them) replay the mixed graphs too, each sequence run token by token from its
slot (model/linear_state.py's LinearGraphRows, over the `linear_*` buffers); longer chunks run eagerly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from decoder_svc.model import KVCacheSpec, LlamaForCausalLM, allocate_kv_cache
from decoder_svc.model.attention import AttentionMetadata
from decoder_svc.model.kv_groups import KVCacheGroup, split_kv_blocks
from decoder_svc.model.linear_state import (
    LinearChunk,
    LinearGraphRows,
    LinearStatePool,
    LinearStateStep,
    continues_slot,
    graph_takes,
    stage_graph_rows,
)
from decoder_svc.runner.cuda_graphs import GraphKey, StepGraphs
from decoder_svc.runner.embed_rows import embed_rows, fill_pending
from decoder_svc.runner.fusion import fuse_image_rows, image_key_limits, image_slots
from decoder_svc.runner.inputs import PENDING_TOKEN, ModelInput, ModelOutput, SequenceInput
from decoder_svc.runner.piecewise_graphs import Break
from decoder_svc.runner.runner_config import RunnerConfig
from decoder_svc.runner.sampler import PendingSample, Sampler, SamplerOutput
from decoder_svc.runner.step_buffers import StepBuffers, graph_rows_used, slot_key, table_key

log = logging.getLogger("mmserve.decoder.runner")


def describe(group: KVCacheGroup) -> str:
    """A KV cache group in words (the start-up log)."""
    pattern = f"window {group.window}" if group.window else "full"
    return f"{len(group.layers)} layers {pattern}: {group.num_blocks} blocks"


@dataclass
class PreparedStep:
    """A step's tensors, views into the persistent buffers."""

    num_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | list[AttentionMetadata]  # one per KV cache group where there are several
    logits_indices: torch.Tensor
    image_slots: torch.Tensor | None  # flat rows that take image embeddings
    pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows of input_ids, rows of the last samples)
    lora_slots: torch.Tensor | None = None  # each token row's adapter slot
    linear_state: LinearStateStep | None = None  # a hybrid stack's state slots for this step


@dataclass
class _HostRows:
    """How far a step's host staging is filled: token rows, sequences, logit rows, pending rows, the
    longest query, each image sequence's flat image rows, and the key limits buffer when it is used."""

    limits: np.ndarray | None
    t: int = 0
    num_seqs: int = 0
    max_q: int = 0
    n_logits: int = 0
    n_pending: int = 0
    state_rows: int = 0  # rows of `state_slots` filled (a hybrid stack's graph)
    # sequences whose block tables the step reads: its own (a graph's pad sequences have no context, so
    # their rows of the device tables are never read and not copied: 64 KiB a row at 262144 positions)
    tables: int = 0
    linear_graph: bool = False  # a hybrid mixed graph's LinearGraphRows buffers filled too
    img: list[np.ndarray] = dataclasses.field(default_factory=list)
    # (first row, tokens, start position, state slot, snapshots) per sequence, for a hybrid stack's
    # linear layers (model/linear_state.py)
    linear: list[tuple] = dataclasses.field(default_factory=list)


class LaunchedStep:
    """A step queued on the device; `result()` waits for its sampled tokens."""

    def __init__(self, sampled: PendingSample | None) -> None:
        self._sampled = sampled

    def result(self) -> ModelOutput:
        """The step's sampled tokens (the step's one host synchronisation)."""
        return ModelOutput(self._sampled.result() if self._sampled is not None else SamplerOutput([], []))


class ModelRunner:
    """Runs steps of the language model over the paged KV cache; knows nothing of the scheduler."""

    def __init__(self, model: LlamaForCausalLM, config: RunnerConfig, mm_token_ids: list[int]) -> None:
        self.model = model
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = model.config
        self._on_cuda = self.device.type == "cuda"
        if self._on_cuda and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton launches on the current device
        self.mm_token_ids = np.asarray(sorted(mm_token_ids), dtype=np.int64)
        self.max_blocks_per_seq = -(-self.model_config.max_model_len // config.block_size)
        self.graphs: StepGraphs | None = None
        # A hybrid stack's state slots (allocated with the KV cache); only its decode steps have graphs.
        self.hybrid = bool(self.model_config.linear_layers)
        self.linear_pool: LinearStatePool | None = None
        self.pad_state_slot = -1  # the slot a decode graph's pad rows read and write (hybrid, graphs)
        self._decode_rows: torch.Tensor | None = None  # 0, 1, ...: a hybrid decode graph's token rows
        self.linear_graphs = False  # a hybrid stack's mixed graphs run its linear layers
        if not config.enforce_eager and StepGraphs.available(self.device, model.backend):
            adapters = self.model.lora
            self.linear_graphs = self.hybrid and model.graphs_run_linear_steps(self.device)
            self.graphs = StepGraphs(config.max_num_seqs, config.max_num_batched_tokens,
                                     lora=adapters is not None,
                                     merged=adapters is not None and adapters.merged_slot is not None,
                                     decode_only=self.hybrid and not self.linear_graphs,
                                     deepstack=config.deepstack_levels > 0,
                                     piecewise=config.piecewise_graphs and self.linear_graphs)
        graph_rows = self.graphs.max_tokens if self.graphs is not None else 0
        taps = self.model_config.linear_conv_kernel if self.linear_graphs else 0  # the graphs' conv codes
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs, graph_rows)
        hidden = self.model_config.hidden_size if graph_rows else 0  # the graphs' input embeddings
        self.mrope = model.uses_mrope
        self.num_groups = len(model.kv_groups)  # KV cache groups (model/kv_groups.py)
        self.buffers = StepBuffers(max_tokens, max(config.max_num_seqs, graph_rows), self.max_blocks_per_seq,
                                   hidden, config.dtype, self.device, position_rows=3 if self.mrope else 1,
                                   num_groups=self.num_groups, conv_taps=taps,
                                   graph_tokens=graph_rows, deepstack_levels=config.deepstack_levels)
        # what each linear layer's token mixing writes for a piecewise graph's next piece to read
        self._mix_out = None
        if self.graphs is not None and self.graphs.piecewise_sizes:
            shape = (self.graphs.max_tokens, self.model_config.linear_num_value_heads,
                     self.model_config.linear_value_head_dim)
            self._mix_out = torch.zeros(shape, dtype=config.dtype, device=self.device)
        self.sampler = Sampler(self.device)
        self.kv_spec: KVCacheSpec | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._staged = torch.cuda.Event() if self._on_cuda else None  # host buffers free to refill
        self.graph_steps = 0  # steps that replayed a CUDA graph (stats, tests)
        # steps with the per-row LoRA product, and steps on a merged adapter's weights (stats, tests)
        self.lora_steps = 0
        self.merged_steps = 0
        # The last launched step's sampled tokens (device) and each sampling request's row in them: where
        # the next step's pending tokens come from.
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        # Tensor parallelism: every rank must size its KV cache alike (runner/tensor_parallel.py).
        self.agree_blocks: Callable[[int], int] = lambda count: count

    # -- start-up ----------------------------------------------------------------------------------
    @property
    def uses_cuda_graphs(self) -> bool:
        """True when small steps replay captured graphs."""
        return self.graphs is not None

    def initialize(self) -> KVCacheSpec:
        """Warm up (measuring activation memory), size and allocate the KV cache, capture the graphs."""
        if self._on_cuda:
            self._profile_run()
        num_blocks = self.agree_blocks(self._num_kv_blocks())
        cfg = self.config
        if self.num_groups == 1:
            self.kv_spec = KVCacheSpec.for_model(self.model_config, num_blocks, cfg.block_size, cfg.dtype)
        else:  # every rank splits the agreed count alike
            groups = split_kv_blocks(self.model.kv_groups, num_blocks, cfg.block_size, cfg.max_num_seqs,
                                     cfg.max_num_batched_tokens, self.max_blocks_per_seq * cfg.max_num_seqs)
            self.kv_spec = KVCacheSpec.for_groups(self.model_config, groups, cfg.block_size, cfg.dtype)
            pools = ", ".join(describe(g) for g in groups)
            log.info("KV cache groups out of %d blocks of every layer (rule: model/kv_groups.py): %s",
                     num_blocks, pools)
        self.kv_caches = allocate_kv_cache(self.kv_spec, self.device)
        if self.hybrid:
            slots = cfg.state_slots + cfg.num_state_snapshots
            if self.graphs is not None:  # one more, past every slot the engine hands out
                self.pad_state_slot = slots
            self.linear_pool = LinearStatePool.allocate(self.model_config, slots + (self.graphs is not None),
                                                        cfg.dtype, self.device)
            log.info("state slots of %d linear-attention layers: %d for requests, %d for snapshots "
                     "(%.1f MiB)",
                     len(self.model_config.linear_layers), cfg.state_slots, cfg.num_state_snapshots,
                     self._state_bytes() / 2**20)
        if self.graphs is not None:
            # Capture over a valid empty step: one token per sequence, no slots, no context.
            d = self.buffers.dev
            self.buffers.set("query_start_loc", torch.arange(d["query_start_loc"].numel(), dtype=torch.int32))
            self.buffers.set("logits_indices", torch.arange(d["logits_indices"].numel()))
            if self.hybrid:
                self.buffers.set("state_slots", torch.full_like(d["state_slots"], self.pad_state_slot))
                self._decode_rows = torch.arange(d["state_slots"].numel(), device=self.device)
            if self.linear_graphs:  # every sequence a pad: fresh, zero inputs, the pad slot, no snapshot
                pad = self.pad_state_slot
                for name, value in (("fresh", 1), ("snapshot_rows", -1), ("snapshot_slots", pad),
                                    ("window_slots", pad), ("window_codes", -1), ("conv_codes", -1)):
                    self.buffers.set(f"linear_{name}", torch.full_like(d[f"linear_{name}"], value))
            self.graphs.capture(self._run_static, progress=self.config.progress, mix_out=self._mix_out)
            log.info("captured %d CUDA graphs (decode %s, up to %d tokens %s%s) in %.0f MiB",
                     len(self.graphs.keys), self.graphs.decode_sizes, self.graphs.max_tokens,
                     self.graphs.mixed_sizes, f", piecewise {self.graphs.piecewise_sizes}"
                     if self.graphs.piecewise_sizes else "", self.graphs.memory_bytes / 2**20)
        return self.kv_spec

    def _state_bytes(self) -> int:
        """Bytes of a hybrid stack's state and snapshot slots, and a decode graph's pad slot (0 for other
        stacks)."""
        slots = self.config.state_slots + self.config.num_state_snapshots + (self.graphs is not None)
        return slots * LinearStatePool.bytes_per_slot(self.model_config, self.config.dtype)

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = KVCacheSpec.bytes_per_block(self.model_config, cfg.block_size, cfg.dtype)
        budget = cfg.kv_cache_bytes
        if budget is None:
            budget = torch.cuda.mem_get_info(self.device)[0] // 2 if self._on_cuda else 512 << 20
        budget = max(budget - self._state_bytes(), per_block)  # the state slots come out of the budget
        # No point holding more than every sequence at full length.
        useful = self.max_blocks_per_seq * cfg.max_num_seqs
        return max(1, min(budget // per_block, useful))

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """One forward of the largest prefill (compiling its kernels), so the KV budget is taken from the
        memory left after the activations' peak; a few more that compile the attention's other prefill
        variants; then one of a single token (decode's kernels)."""
        n = min(self.config.max_num_batched_tokens, self.model_config.max_model_len)
        bs = self.config.block_size
        scratch = allocate_kv_cache(KVCacheSpec.for_model(self.model_config, 1, bs, self.config.dtype),
                                    self.device)
        meta = AttentionMetadata.build([-1] * n, [n], [n], [[0] * -(-n // bs)], bs, self.device)
        rows = torch.arange(n - min(n, self.config.max_num_seqs), n, device=self.device)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        positions = torch.arange(n, device=self.device)
        states = LinearStatePool.allocate(self.model_config, 1, self.config.dtype, self.device)
        fresh = functools.partial(self._fresh_state, states)
        self.model(positions.expand(3, n) if self.mrope else positions, meta, scratch, rows, input_ids=ids,
                   linear_state=fresh(n))
        # The attention kernel's other prefill variants, compiled now rather than in a request's step: a
        # short chunk (its keys split among programs), and for bidirectional images both with key limits.
        short = min(n, 64)
        for chunk, limits in ((short, False), (n, True), (short, True)):
            if limits and not self.config.image_blocks:
                continue
            m = AttentionMetadata.build([-1] * chunk, [chunk], [chunk], [[0] * -(-chunk // bs)], bs,
                                        self.device)
            m.key_limits = positions[:chunk] if limits else None  # its own position: causal, as a limit
            last = torch.full((1,), chunk - 1, device=self.device)
            self.model(positions[:chunk].expand(3, chunk) if self.mrope else positions[:chunk], m, scratch,
                       last, input_ids=ids[:chunk], linear_state=fresh(chunk))
        # One token: the ops time their one-row kernels here (decode_gemv), before any graph is captured.
        one = AttentionMetadata.build([-1], [1], [1], [[0]], bs, self.device)
        self.model(positions[:1].expand(3, 1) if self.mrope else positions[:1], one, scratch, rows[:1] * 0,
                   input_ids=ids[:1], linear_state=fresh(1))
        torch.cuda.synchronize(self.device)
        del scratch, states, fresh
        torch.cuda.empty_cache()

    def _fresh_state(self, pool: LinearStatePool, tokens: int) -> LinearStateStep | None:
        """A step of one new sequence of `tokens` in slot 0 of `pool` (a hybrid stack's; else None)."""
        return LinearStateStep.build(pool, [(0, tokens, 0, 0, ())], self.device) if self.hybrid else None

    def _logit_rows(self, key: GraphKey) -> int:
        """Rows of logits a graph computes: one per sequence that may sample."""
        return key.num_seqs if key.decode else min(key.num_tokens, self.config.max_num_seqs)

    def _run_static(self, key: GraphKey, cut: Break | None = None) -> torch.Tensor:
        """The model over the static buffers, shaped as `key` (what a graph captures). It must write no
        buffer: a write would be captured and repeated at every replay. `cut`: a piecewise key's break at
        each linear layer's mixing (None: the mixing runs in place, over a pad sequence)."""
        d, n_tok, n_seq, n_logits = self.buffers.dev, key.num_tokens, key.num_seqs, self._logit_rows(key)
        meta = self._group_metas(AttentionMetadata(
            d["slot_mapping"][:n_tok], d["query_start_loc"][:n_seq + 1], d["seq_lens"][:n_seq],
            d["block_tables"][:n_seq], self.config.block_size, max_query_len=1 if key.decode else n_tok))
        return self.model(self._positions(d["positions"], n_tok, key.decode), meta, self.kv_caches,
                          d["logits_indices"][:n_logits],
                          inputs_embeds=self.buffers.embeds[:n_tok],
                          deepstack=(None, self.buffers.deepstack[:, :n_tok]) if key.deepstack else None,
                          lora_slots=d["lora_slots"][:n_tok] if key.lora else None,
                          linear_state=self._graph_linear_state(key, cut), merged_adapter=key.merged)

    def _graph_linear_state(self, key: GraphKey, cut: Break | None = None) -> LinearStateStep | None:
        """A hybrid stack's graph's view of the state slots (None for other stacks): a decode graph's rows
        each a one-token continuation of the slot its sequence row names in `state_slots`; a mixed
        graph's sequences as LinearGraphRows over the step's buffers; a piecewise graph's mixing handed to
        `cut`, or (its warm-up) run over one fresh pad sequence of all its rows in the pad slot."""
        if not self.hybrid:
            return None
        if key.piecewise:
            pad = LinearChunk(0, key.num_tokens, self.pad_state_slot, fresh=True)
            return LinearStateStep(self.linear_pool, (pad,), piecewise=cut)
        n, d = key.num_seqs, self.buffers.dev
        if key.decode:
            return LinearStateStep(self.linear_pool, (), self._decode_rows[:n], d["state_slots"][:n])
        used = graph_rows_used(n, key.num_tokens)
        return LinearStateStep(self.linear_pool, graph=LinearGraphRows(
            d["query_start_loc"][:n + 1], d["state_slots"][:n],
            **{name: d[f"linear_{name}"][:rows] for name, rows in used.items()}))

    def _group_metas(self, meta: AttentionMetadata) -> AttentionMetadata | list[AttentionMetadata]:
        """meta (group 0's) alone for one KV cache group; else one per group: the same lengths, each
        group's slots and tables (views of the same rows of its buffers)."""
        if self.num_groups == 1:
            return meta
        d = self.buffers.dev
        n_tok, n_seq = meta.slot_mapping.shape[0], meta.block_tables.shape[0]
        return [meta] + [dataclasses.replace(meta, slot_mapping=d[slot_key(g)][:n_tok],
                                             block_tables=d[table_key(g)][:n_seq])
                         for g in range(1, self.num_groups)]

    # -- the step ----------------------------------------------------------------------------------
    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy KV blocks (group, source, destination) in every layer of their group, keys and values,
        queued on the device before the step that reads them."""
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for group, src, dst in copies:
            srcs, dsts = by_group.setdefault(group, ([], []))
            srcs.append(src)
            dsts.append(dst)
        pools = self.kv_spec.pools
        for group, (srcs, dsts) in by_group.items():
            src_t = torch.tensor(srcs, dtype=torch.long, device=self.device)
            dst_t = torch.tensor(dsts, dtype=torch.long, device=self.device)
            for layer in pools[group].layers:
                cache = self.kv_caches[layer]
                cache.index_copy_(1, dst_t, cache.index_select(1, src_t))

    def execute(self, batch: ModelInput) -> ModelOutput:
        """Run one step; sample for every sequence that has `sampling`. An empty batch only drops the
        state of finished requests."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: ModelInput) -> LaunchedStep:
        """`execute` without waiting for the sampled tokens: the step is queued on the device. A sequence
        whose last token is PENDING_TOKEN takes the token the previous launch sampled for its request."""
        for request_id in batch.finished_request_ids:
            self.sampler.forget(request_id)
        if batch.block_copies:
            self.copy_blocks(batch.block_copies)
        if batch.state_copies:
            self.linear_pool.copy_slots(batch.state_copies)
        if not batch.sequences:
            return LaunchedStep(None)
        if self._on_cuda and self.device.index is not None:
            torch.cuda.set_device(self.device)  # the engine thread may not be the one that built us
        key = None
        # Steps with multi-part image rows (DeepStack) take the graphs with the level buffer; rows with
        # another number of levels than the buffer's run eagerly.
        multipart = any(r.dim() == 3 for s in batch.sequences for r in s.image_rows)
        deepstack_ok = not multipart or self.buffers.deepstack is not None and all(
            r.dim() == 3 and r.shape[0] - 1 == self.buffers.deepstack.shape[0]
            for s in batch.sequences for r in s.image_rows)
        # Steps whose images attend bidirectionally run eagerly: the graphs have no key limits.
        blocks = self.config.image_blocks and any(s.image_rows for s in batch.sequences)
        lora, merged = self._adapter_path(batch)
        self.lora_steps += lora
        self.merged_steps += merged
        if self.graphs is not None and deepstack_ok and not blocks:
            if self._graphable(batch):
                key = self.graphs.key_for(len(batch.sequences), batch.num_tokens,
                                          self._decode_graphable(batch), lora, merged, deepstack=multipart)
            elif self.graphs.piecewise_sizes and not lora and not merged:  # a hybrid stack's longer step
                key = self.graphs.key_for(len(batch.sequences), batch.num_tokens, False, piecewise=True)
        step = self._prepare(batch, key, lora)
        rows = [s.sampling for s in batch.sequences if s.sampling is not None]
        image_rows = [r for s in batch.sequences for r in s.image_rows]
        if key is not None:
            self.graph_steps += 1
            embeds = self.buffers.embeds[:step.num_tokens]
            # pending ids taken from the last samples, then the rows gathered (one kernel on CUDA)
            embed_rows(embeds, self.model.embed_tokens.weight, step.input_ids, step.pending,
                       self._last_tokens)
            scale = self.model.config.embed_scale
            if scale is not None:  # what model.embed does (Gemma)
                embeds.mul_(torch.tensor(scale, dtype=embeds.dtype, device=embeds.device))
        else:
            fill_pending(step.input_ids, step.pending, self._last_tokens)  # before the lookup reads them
            embeds = self.model.embed(step.input_ids)
        deepstack = None
        if step.image_slots is not None:
            levels = fuse_image_rows(embeds, step.image_slots, image_rows)
            deepstack = (step.image_slots, levels) if levels is not None else None
        if key is not None and key.deepstack:  # the graph's level buffer: this step's rows, zeros elsewhere
            buffer = self.buffers.deepstack[:, :key.num_tokens]
            buffer.zero_()
            buffer[:, deepstack[0]] = deepstack[1]
        if key is not None:
            logits = self.graphs.replay(key, step.linear_state, batch.num_tokens)[:len(rows)]
        else:
            positions = self._positions(step.positions, step.num_tokens, batch.is_plain_decode)
            logits = self.model(positions, step.meta, self.kv_caches, step.logits_indices,
                                inputs_embeds=embeds, deepstack=deepstack, lora_slots=step.lora_slots,
                                linear_state=step.linear_state, merged_adapter=merged)
        if not rows:
            self._last_tokens, self._last_rows = None, {}
            return LaunchedStep(None)
        sampled = self.sampler.sample_async(logits, rows)
        self._last_tokens, self._last_rows = sampled.tokens, {r.request_id: i for i, r in enumerate(rows)}
        return LaunchedStep(sampled)

    def _graphable(self, batch: ModelInput) -> bool:
        """Whether a graph may run the step: any other stack's always; a hybrid stack's when its decode
        graphs compute it, or (with linear_graphs) when a graph's rows take every sequence (graph_takes)."""
        if self._decode_graphable(batch):
            return True
        return not self.hybrid or self.linear_graphs and all(
            graph_takes(s.num_tokens, s.state_snapshots) for s in batch.sequences)

    def _decode_graphable(self, batch: ModelInput) -> bool:
        """Whether a decode graph computes the step: one text token per sequence, and for a hybrid stack
        each continuing its slot without a snapshot (a first token starts from a zero state instead)."""
        return batch.is_plain_decode and (not self.hybrid or all(
            continues_slot(s.num_tokens, s.start, s.state_snapshots) for s in batch.sequences))

    def _adapter_path(self, batch: ModelInput) -> tuple[bool, bool]:
        """(lora, merged) for a step: `lora` when some row runs an adapter (the per-row product); instead
        `merged` when every row runs the adapter merged at load (its merged weights, model/lora/merged.py).
        Neither: the base model, whose one-row fused products the LoRA kernels would forgo."""
        adapters = self.model.lora
        if adapters is None:
            return False, False
        slots = {s.lora_slot for s in batch.sequences}
        if adapters.merged_slot is not None and slots == {adapters.merged_slot}:
            return False, True
        return slots != {0}, False

    def _prepare(self, batch: ModelInput, key: GraphKey | None, lora: bool = False) -> PreparedStep:
        """Fill the host staging for this step, copy it to the device, and return views of the buffers.
        For a graph, pad to its shape: one-token sequences with no slot and no context, then empty ones.
        `lora`: some row has an adapter (the rows' slots are uploaded only then)."""
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copies have left the pinned buffers
        h = self.buffers.np
        h["query_start_loc"][0] = 0
        rows = _HostRows(limits=h["key_limits"] if key is None and self.config.image_blocks else None)
        for i, seq in enumerate(batch.sequences):
            self._stage_sequence(rows, i, seq, lora)
        rows.num_seqs = rows.tables = len(batch.sequences)
        if key is not None:
            self._pad_to_graph(rows, key, lora)
        if key is not None and self.hybrid and not key.piecewise:  # (a piecewise graph's mixing: eager)
            self._stage_state_slots(rows, key)
        self._upload(rows, lora)
        slots_dev = None
        if rows.img:
            slots_dev = torch.from_numpy(np.concatenate(rows.img)).to(self.device, non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        return self._device_views(rows, slots_dev, lora, key)

    def _stage_sequence(self, rows: _HostRows, i: int, seq: SequenceInput, lora: bool) -> None:
        """Write sequence i's tokens, slots, positions, block tables and sampling rows into the staging."""
        h = self.buffers.np
        ids, t, n = h["input_ids"], rows.t, seq.num_tokens
        if len(seq.group_tables) != self.num_groups - 1:  # stale slots would write into live blocks
            raise ValueError(f"a sequence needs a block table for each of {self.num_groups} KV groups")
        ids[t:t + n] = seq.token_ids
        if lora:
            h["lora_slots"][t:t + n] = seq.lora_slot
        if seq.token_ids[-1] == PENDING_TOKEN:
            h["pending_rows"][rows.n_pending] = t + n - 1
            h["pending_samples"][rows.n_pending] = self._pending_source(seq)
            rows.n_pending += 1
        p = self._stage_slots(seq, t)
        if self.mrope:
            self._mrope_positions(h["positions"][:, t:t + n], seq)
        else:
            h["positions"][t:t + n] = p
        h["block_tables"][i, :len(seq.block_table)] = seq.block_table
        for g, gt in enumerate(seq.group_tables, 1):
            h[table_key(g)][i, :len(gt)] = gt
        h["seq_lens"][i] = seq.end
        if self.hybrid:
            rows.linear.append((t, n, seq.start, seq.state_slot, tuple(seq.state_snapshots)))
        if seq.image_rows:
            image_rows = image_slots(ids[t:t + n], seq.start, seq.num_prompt_tokens, self.mm_token_ids)
            rows.img.append(t + image_rows)
        if rows.limits is not None:
            rows.limits[t:t + n] = image_key_limits(rows.img[-1] - t if seq.image_rows else (), seq.start, n)
        rows.t = t = t + n
        h["query_start_loc"][i + 1] = t
        rows.max_q = max(rows.max_q, n)
        if seq.sampling is not None:
            h["logits_indices"][rows.n_logits] = t - 1
            rows.n_logits += 1

    def _stage_slots(self, seq: SequenceInput, t: int) -> int | np.ndarray:
        """Write the KV slots of seq's tokens (from row t) for every group; returns their positions."""
        h, bs, n, table = self.buffers.np, self.config.block_size, seq.num_tokens, seq.block_table
        if n == 1:  # decode: skip numpy's per-call overhead
            p = seq.start
            h["slot_mapping"][t] = table[p // bs] * bs + p % bs
            for g, gt in enumerate(seq.group_tables, 1):
                h[slot_key(g)][t] = gt[p // bs] * bs + p % bs
            return p
        p = np.arange(seq.start, seq.end)
        h["slot_mapping"][t:t + n] = np.asarray(table, dtype=np.int64)[p // bs] * bs + p % bs
        for g, gt in enumerate(seq.group_tables, 1):
            h[slot_key(g)][t:t + n] = np.asarray(gt, dtype=np.int64)[p // bs] * bs + p % bs
        return p

    def _pad_to_graph(self, rows: _HostRows, key: GraphKey, lora: bool) -> None:
        """Pad the staging to a captured graph's shape: one-token sequences with no slot, then empty ones."""
        h, t, num_seqs = self.buffers.np, rows.t, rows.num_seqs
        pad = key.num_tokens - t
        h["input_ids"][t:t + pad], h["positions"][..., t:t + pad], h["slot_mapping"][t:t + pad] = 0, 0, -1
        if lora:
            h["lora_slots"][t:t + pad] = 0
        for g in range(1, self.num_groups):
            h[slot_key(g)][t:t + pad] = -1
        starts = h["query_start_loc"]
        starts[num_seqs + 1:num_seqs + pad + 1] = np.arange(t + 1, t + pad + 1)
        starts[num_seqs + pad + 1:key.num_seqs + 1] = key.num_tokens
        h["seq_lens"][num_seqs:key.num_seqs] = 0
        h["logits_indices"][rows.n_logits:self._logit_rows(key)] = 0
        rows.t, rows.num_seqs, rows.n_logits = key.num_tokens, key.num_seqs, self._logit_rows(key)

    def _stage_state_slots(self, rows: _HostRows, key: GraphKey) -> None:
        """A hybrid graph's state slot per sequence row (pad rows: the pad slot); for a mixed graph its
        sequences' LinearGraphRows too."""
        h = self.buffers.np
        rows.state_rows = key.num_seqs
        if not key.decode:
            out = {name: h[f"linear_{name}"] for name in graph_rows_used(0, 0)}
            out["slots"], out["conv_codes"] = h["state_slots"], out["conv_codes"][:key.num_tokens]
            stage_graph_rows(rows.linear, key.num_seqs, self.pad_state_slot, out)
            rows.linear_graph = True
            return
        slots = h["state_slots"]
        slots[:key.num_seqs] = self.pad_state_slot
        for i, (_, _, _, slot, _) in enumerate(rows.linear):
            slots[i] = slot

    def _upload(self, rows: _HostRows, lora: bool) -> None:
        """Copy the filled part of each staging buffer to the device (asynchronously)."""
        t, num_seqs, limited = rows.t, rows.num_seqs, rows.limits is not None
        self.buffers.upload({"input_ids": t, "positions": t, "slot_mapping": t,
                             "query_start_loc": num_seqs + 1, "seq_lens": num_seqs,
                             "block_tables": rows.tables,
                             "logits_indices": rows.n_logits, "pending_rows": rows.n_pending,
                             "pending_samples": rows.n_pending, "key_limits": t if limited else 0,
                             "lora_slots": t if lora else 0, "state_slots": rows.state_rows,
                             **{f"linear_{name}": n * rows.linear_graph
                                for name, n in graph_rows_used(rows.state_rows, t).items()},
                             **{k: n for g in range(1, self.num_groups)
                                for k, n in ((slot_key(g), t), (table_key(g), rows.tables))}})

    def _device_views(self, rows: _HostRows, slots_dev: torch.Tensor | None, lora: bool,
                      graph: GraphKey | None = None) -> PreparedStep:
        """The step's tensors: views of the device buffers as far as the staging was filled."""
        t, num_seqs, n_pending, limited = rows.t, rows.num_seqs, rows.n_pending, rows.limits is not None
        d, host = self.buffers.dev, self.buffers.host
        meta = self._group_metas(AttentionMetadata(
            d["slot_mapping"][:t], d["query_start_loc"][:num_seqs + 1], d["seq_lens"][:num_seqs],
            d["block_tables"][:num_seqs], self.config.block_size, max_query_len=rows.max_q,
            query_start_loc_cpu=host["query_start_loc"][:num_seqs + 1],
            seq_lens_cpu=host["seq_lens"][:num_seqs],
            key_limits=d["key_limits"][:t] if limited else None,
            key_limits_cpu=host["key_limits"][:t] if limited else None))
        pending = (d["pending_rows"][:n_pending], d["pending_samples"][:n_pending]) if n_pending else None
        linear = (LinearStateStep.build(self.linear_pool, rows.linear, self.device)
                  if self.hybrid and (graph is None or graph.piecewise) else None)
        return PreparedStep(t, d["input_ids"][:t], d["positions"][..., :t], meta,
                            d["logits_indices"][:rows.n_logits], slots_dev, pending,
                            d["lora_slots"][:t] if lora else None, linear)

    def _pending_source(self, seq: SequenceInput) -> int:
        """The row of the last launch's samples that holds seq's pending token."""
        row = self._last_rows.get(seq.sampling.request_id) if seq.sampling is not None else None
        if row is None or seq.token_ids.count(PENDING_TOKEN) != 1:
            raise ValueError("a pending token must be its sequence's last, sampled by the previous launch")
        return row

    def _positions(self, positions: torch.Tensor, n: int, plain_decode: bool) -> torch.Tensor:
        """The first n positions as the model takes them. M-RoPE's three rows are equal for text tokens,
        so a plain decode step passes one row: the model then reads its rotary table directly."""
        if self.mrope:
            return positions[0, :n] if plain_decode else positions[:, :n]
        return positions[:n]

    @staticmethod
    def _mrope_positions(out: np.ndarray, seq: SequenceInput) -> None:
        """Fill out [3, n] with the M-RoPE positions of seq's tokens: the request's own below its prompt's
        end, index + delta after it (generated tokens, or a request without images)."""
        start, end, prompt = seq.start, seq.end, seq.num_prompt_tokens
        known = seq.mrope_positions
        split = max(start, min(end, prompt)) if known is not None else start
        if split > start:
            out[:, :split - start] = known[:, start:split]
        if end > split:
            out[:, split - start:] = np.arange(split, end) + seq.mrope_delta
