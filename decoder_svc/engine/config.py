"""The engine's configuration (a light module: the command line reads it without loading torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.arg_types import (
    dtype_name,
    lora_module,
    lora_modules_dict,
    model_dir,
    non_negative_int,
    positive_int,
    require_local_weights,
)
from common.config import check_options, option
from common.devices import resolve_device_and_dtype
from common.images import ImageLimits
from common.video.limits import VideoLimits


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Fields made with `option` are the decoder's command-line
    flags too (common/config.py); the rest are set in code."""

    model: str | Path = option(
        help="checkpoint of a served family: a directory, or a Hugging Face Hub id (in the HF cache, else "
        "downloaded unless HF_HUB_OFFLINE=1)", type=model_dir)
    device: str = option("auto", "auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto (the checkpoint's dtype on a GPU, float32 on CPU), float32, float16 or "
                        "bfloat16", type=dtype_name)
    block_size: int = option(16, "tokens per KV block", type=positive_int)
    num_kv_blocks: int | None = option(None, "KV blocks in the pool", type=positive_int, group="kv")
    kv_cache_bytes: int | None = option(
        None, "KV cache size (default: half the free GPU memory, or 512 MiB on CPU)", type=positive_int,
        group="kv")
    max_num_batched_tokens: int = option(2048, "token budget per step", type=positive_int)
    max_num_seqs: int = option(64, "running requests at most", type=positive_int)
    encoder_max_ahead: int = option(
        4, "queued requests whose images are requested ahead of their prefill (0: off)",
        type=non_negative_int)
    default_max_tokens: int = option(256, "max_tokens when a request gives 0", flag="--max-tokens-default",
                                     type=positive_int)
    max_waiting: int = option(4096, "queue size before RESOURCE_EXHAUSTED", type=positive_int)
    enable_prefix_caching: bool = option(True, "no reuse of cached prefix KV", flag="--no-prefix-caching")
    attention_backend: str = option("auto", "kernels: auto takes Triton on CUDA and the torch reference "
                                    "elsewhere", choices=("auto", "torch", "triton"))
    enforce_eager: bool = option(False, "no CUDA graphs for decode steps")
    piecewise_graphs: bool = option(
        False, "a hybrid model's (linear attention) longer prefill steps replay piecewise CUDA graphs: "
        "everything but the linear layers' token mixing, which runs eagerly between the pieces "
        "(experimental: slower than eager on an H100 for a 9B hybrid model, its steps padded to the "
        "next graph; see BENCHMARKS.md)")
    warm_up: str = option(
        "auto", "before the service is ready: 'full' runs a cold prompt of every step shape, two at once, "
        "and a follow-up resumed from its prefix, so that the first users find the GPU's kernels compiled; "
        "'short' one 2-token request; auto: full on a GPU", choices=("auto", "full", "short"))
    async_scheduling: str = option(
        "auto", "launch each step before reading the previous one's tokens, so the host's work between "
        "steps overlaps the GPU's: auto (on with CUDA and one rank), on, off", choices=("auto", "on", "off"))
    quantization: str = option(
        "none", "fp8: quantize the decoder layers' projections to FP8 (e4m3, per output channel) at load; "
        "FP8 checkpoints (compressed-tensors, HF fine-grained) are served in FP8 whatever this says",
        choices=("none", "fp8"))
    deterministic: bool = option(
        False, "batch-invariant serving: every product and attention row computed the same way whatever "
        "else shares the step, so a greedy request (and a seeded one) gives the same tokens and logprobs "
        "alone, in any batch, chunked or not, from a cold or a warm prefix cache (with the encoder's "
        "--deterministic, whatever images shared its tower batch). Costs throughput (BENCHMARKS.md); not "
        "with --tensor-parallel-size > 1 nor FP8 projections")
    lora_modules: list[str] = option(
        help="LoRA adapters (PEFT's directory layout) a request may name: gRPC GenerateRequest.lora_adapter, "
        "or the gateway's `model`. Each is served per request inside shared batches; prefix-cache entries "
        "are keyed by it (a dict {name: path} in code). vLLM's JSON form '{\"name\": ..., \"path\": ..., "
        "\"base_model_name\": ...}' too (base_model_name is the gateway's; ignored here). A name given "
        "twice is refused", metavar="NAME=PATH", append=True, nargs="+",
        default_factory=list, type=lora_module)
    merge_builtin_adapter: bool = option(
        True, "no merged copy of the checkpoint's own LoRA adapter (a vision adapter it carries, which "
        "every image request runs). By default each projection it targets gets a second copy at load, W + "
        "B @ A in the model's dtype, and a step whose rows all run the adapter uses those instead of the "
        "per-row LoRA product (steps that mix it with text or another adapter keep the product). The cost: "
        "the targeted projections' weights again (logged at load); an adapter that targets every layer's "
        "qkv, o, gate_up and down projections copies nearly all of the decoder layers (0.84x the language "
        "model's weights for the one served family that has one), taken from the memory the KV "
        "cache would get. Where memory is tight, turn it off (skipped by itself, with a warning, when the "
        "copy would take over half the GPU memory free at load). Never merged with --deterministic or FP8 "
        "projections", flag="--no-merge-builtin-adapter")
    tensor_parallel_size: int = option(
        1, "ranks the language model is split over (one worker process per other rank; GPU N for rank N "
        "on CUDA, gloo on CPU)", type=positive_int)
    load_format: str = option(
        "auto", "dummy: random weights made on the device from config.json (benchmarks of large shapes, "
        "no weight files needed)", choices=("auto", "dummy"))
    max_image_tokens: int = option(
        16384, "image tokens per image at most (a model that resizes images into a pixel range: caps each "
        "image's max_pixels at this many merged patch blocks)", type=positive_int)
    max_image_tokens_per_request: int = option(32768, "image tokens per request at most", type=positive_int)
    image_limits: ImageLimits = field(default_factory=ImageLimits)  # bytes, side, pixels, images/request
    video_limits: VideoLimits = field(default_factory=VideoLimits)  # bytes, seconds, frames, videos/request
    max_prompt_bytes: int = 1 << 20  # prompt text (or chat text parts), checked before tokenizing
    # False: outputs carry token ids and no text, except for requests with stop strings (stopping needs
    # the text). The service sets it and detokenizes on its event loop, so the engine thread spends
    # its time on steps, not on the tokenizer.
    detokenize: bool = True
    num_state_slots: int | None = option(
        None, "a hybrid model's (linear attention) state slots, one per running request: admission waits for "
        "a free one (default: --max-num-seqs)", type=positive_int)
    num_state_snapshots: int | None = option(
        None, "a hybrid model's state snapshots kept for prefix reuse, least recently used dropped first; "
        "each is one state slot's memory (default: --max-num-seqs; 0: no prefix reuse for such a model)",
        type=non_negative_int)
    state_snapshot_interval: int = option(
        64, "a hybrid model's snapshot is taken every this many KV blocks of a prompt, except inside an "
        "image (besides image ends and the prompt's last block boundary), at a multiple of 64 tokens; "
        "where the linear attention has no state at 64-token bounds (not fla) each one cuts a prefill "
        "chunk's call in two", type=positive_int)

    def __post_init__(self) -> None:
        if isinstance(self.lora_modules, dict):
            self.lora_modules = [f"{name}={path}" for name, path in self.lora_modules.items()]
        check_options(self)
        lora_modules_dict(self.lora_modules)  # a name given twice
        if self.deterministic and self.tensor_parallel_size > 1:
            raise ValueError("--deterministic is not supported with --tensor-parallel-size > 1 (the "
                             "all-reduce's summation order follows the batch)")
        if self.deterministic and self.quantization == "fp8":
            raise ValueError("--deterministic is not supported with --quantization fp8 (the FP8 kernels are "
                             "chosen by the batch's rows)")
        if self.load_format != "dummy":
            require_local_weights(self.model, " (--load-format dummy draws random weights instead)")
        resolve_device_and_dtype(self)  # auto: cuda when torch sees a GPU; the checkpoint's dtype there

    @property
    def full_warm_up(self) -> bool:
        """Whether the service runs the full warm-up (engine/warm_up.py): --warm-up, auto on a GPU."""
        return self.warm_up == "full" or (self.warm_up == "auto" and str(self.device).startswith("cuda"))

    @property
    def lora_adapters(self) -> dict[str, str]:
        """{adapter name: its directory}, in flag order: adapter i is LoRA slot i + 1 (slot 0: the base)."""
        return lora_modules_dict(self.lora_modules)

    @property
    def served_adapters(self) -> list[str]:
        """Every adapter a request may run with, slot order: --lora-modules', then the checkpoint's own
        (its family's checkpoint_adapters, e.g. Phi-4-multimodal's "vision"); adapter i is slot i + 1."""
        from decoder_svc.model.lora.builtin import builtin_adapter_names

        return [*self.lora_adapters, *builtin_adapter_names(self.model)]
