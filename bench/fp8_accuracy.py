"""FP8 against bf16 on the same weights: greedy top-1 agreement, KL divergence, per-layer hidden-state error.

    python -m bench.fp8_accuracy --model DIR --device cuda --dtype bfloat16 [--prompts 16 --steps 256]

The reference model (the checkpoint in --dtype) decodes --steps greedy tokens for --prompts text
prompts, batched. Then both models are teacher-forced over those sequences step by step, the way a
server decodes (one token per sequence per step, paged KV), and at each step we compare their top-1
tokens: agreement = equal top-1 / steps, and the mean KL(ref || fp8) of their next-token distributions
with the logits of both scaled so that the reference is as peaked as a trained model (calibrate). The
FP8 model is `--quantization fp8` of the same checkpoint (or --fp8-model, a pre-quantized checkpoint).
Per-layer error: ||h_fp8 - h_ref|| / ||h_ref|| of each
decoder layer's output (hidden + residual) over the prompts' prefill, so the growth through depth shows.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.workload import PromptMaker
from common.checkpoint import parse_dtype
from decoder_svc.model import AttentionMetadata, KVCacheSpec, allocate_kv_cache, load_language_model

BLOCK = 16


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the FP8 accuracy benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.fp8_accuracy", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--fp8-model", default=None, help="a pre-quantized FP8 checkpoint (default: "
                   "--quantization fp8 of --model)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--target-top1", type=float, default=0.6,
                   help="logits are scaled until the reference's median top-1 probability reaches this "
                   "(see calibrate)")
    p.add_argument("--out", default=None)
    return p


class Stepper:
    """A model over its own paged KV cache for a fixed batch of sequences: prefill, then one token each."""

    def __init__(self, model, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.device = model, device
        blocks_per_seq = -(-max_len // BLOCK)
        spec = KVCacheSpec.for_model(model.config, batch * blocks_per_seq, BLOCK, dtype)
        self.kv = allocate_kv_cache(spec, device)
        self.tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        self.lens = [0] * batch

    def _slots(self, seq: int, start: int, n: int) -> list[int]:
        return [self.tables[seq][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]

    @torch.inference_mode()
    def forward(self, chunks: list[list[int]]) -> torch.Tensor:
        """Append chunks[i] to sequence i; fp32 logits of each sequence's last new token [batch, vocab]."""
        slots, positions, ids, last = [], [], [], []
        for i, chunk in enumerate(chunks):
            slots += self._slots(i, self.lens[i], len(chunk))
            positions += list(range(self.lens[i], self.lens[i] + len(chunk)))
            ids += chunk
            last.append(len(ids) - 1)
            self.lens[i] += len(chunk)
        meta = AttentionMetadata.build(slots, [len(c) for c in chunks], list(self.lens), self.tables, BLOCK,
                                       self.device)
        pos = torch.tensor(positions, device=self.device)
        if self.model.uses_mrope:
            pos = pos.expand(3, -1)
        return self.model(pos, meta, self.kv, torch.tensor(last, device=self.device),
                          input_ids=torch.tensor(ids, device=self.device))


def layer_outputs(model, ids: list[int], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each decoder layer's output (hidden + residual, fp32) over one prompt's prefill."""
    outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, o: outs.append((o[0] + o[1]).float()))
             for layer in model.layers]
    try:
        Stepper(model, 1, len(ids) + 1, dtype, device).forward([ids])
    finally:
        for h in hooks:
            h.remove()
    return outs


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    model_dir = resolve_model(args)
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    ref = load_language_model(model_dir, device, dtype, load_format=args.load_format)
    fp8 = load_language_model(args.fp8_model or model_dir, device, dtype, quantization="fp8",
                              load_format=args.load_format)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    maker = PromptMaker(model_dir, seed=1)
    prompts = [tokenizer(maker.text(args.prompt_len))["input_ids"] for _ in range(args.prompts)]
    max_len = max(map(len, prompts)) + args.steps + 1

    # The reference's own greedy sequences, and its top-1 probability at each candidate logit scale.
    stepper = Stepper(ref, len(prompts), max_len, dtype, device)
    logits = stepper.forward(prompts)
    greedy = [[int(t)] for t in logits.argmax(-1).tolist()]
    top1 = {scale: [] for scale in SCALES}
    for _ in range(args.steps - 1):
        _note_top1(logits, top1)
        logits = stepper.forward([[g[-1]] for g in greedy])
        for g, t in zip(greedy, logits.argmax(-1).tolist(), strict=True):
            g.append(int(t))
    scale = calibrate(top1, args.target_top1)

    # Teacher-forced decode of those sequences by both models in lockstep: top-1 and KL at every step.
    steppers = [Stepper(m, len(prompts), max_len, dtype, device) for m in (ref, fp8)]
    compare = StepComparison(scale)
    compare.add(*(st.forward(prompts) for st in steppers))
    for s in range(args.steps - 1):
        compare.add(*(st.forward([[g[s]] for g in greedy]) for st in steppers))
    figures = compare.figures()
    distinct = len({t for g in greedy for t in g})

    errors = []
    for ids in prompts[:4]:
        r_out, q_out = layer_outputs(ref, ids, device, dtype), layer_outputs(fp8, ids, device, dtype)
        errors.append([((q - r).norm() / r.norm()).item() for r, q in zip(r_out, q_out, strict=True)])
    per_layer = [sum(col) / len(col) for col in zip(*errors, strict=True)]
    print_table(f"FP8 vs {args.dtype}: {args.prompts} x {args.steps} teacher-forced decode steps (logits x "
                f"{scale:g}: the reference's median top-1 probability {figures['median_top1_prob']:.2f})",
                ["top-1 agreement", "where ref top-1 p >= 0.5", "KL(ref || fp8) nats", "KL at scale 1",
                 "distinct greedy tokens", "layer-0 rel err", "last-layer rel err"],
                [[figures["top1_agreement"], figures["confident_agreement"], figures["kl_mean"],
                  figures["kl_mean_unscaled"], distinct, per_layer[0], per_layer[-1]]])
    return save_result("fp8_accuracy", args, {**figures, "logit_scale": scale, "steps": args.steps,
                                              "prompts": args.prompts, "distinct_greedy_tokens": distinct,
                                              "per_layer_relative_error": per_layer})


SCALES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)


def _note_top1(logits: torch.Tensor, top1: dict[float, list[float]]) -> None:
    for scale, values in top1.items():
        values += torch.softmax(logits.float() * scale, dim=-1).amax(-1).tolist()


def calibrate(top1: dict[float, list[float]], target: float) -> float:
    """The smallest candidate logit scale at which the reference's median top-1 probability reaches target.

    Random weights give flat next-token distributions (top-1 probabilities near 1/vocab), where any
    perturbation flips the argmax and KL means little; trained chat models put a median of roughly
    0.5-0.8 on their top-1 token. Scaling the logits (a temperature below 1, the same for both models)
    gives the random checkpoint that peakedness; argmax agreement does not depend on it, KL and the
    confident-step agreement do."""
    for scale in SCALES:
        if torch.tensor(top1[scale]).median().item() >= target:
            return scale
    return SCALES[-1]


class StepComparison:
    """Running figures of the reference and FP8 logits over the same teacher-forced steps."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.agree: list[torch.Tensor] = []
        self.confident: list[torch.Tensor] = []
        self.kl: list[torch.Tensor] = []
        self.kl_unscaled: list[torch.Tensor] = []
        self.top1_prob: list[torch.Tensor] = []

    @staticmethod
    def _kl(ref: torch.Tensor, fp8: torch.Tensor) -> torch.Tensor:
        lp_ref, lp_q = torch.log_softmax(ref, -1), torch.log_softmax(fp8, -1)
        return (lp_ref.exp() * (lp_ref - lp_q)).sum(-1)

    def add(self, ref: torch.Tensor, fp8: torch.Tensor) -> None:
        """One step's fp32 logits [batch, vocab] of each model."""
        ref, fp8 = ref.float(), fp8.float()
        self.agree.append((ref.argmax(-1) == fp8.argmax(-1)).cpu())
        self.top1_prob.append(torch.softmax(ref * self.scale, -1).amax(-1).cpu())
        self.kl.append(self._kl(ref * self.scale, fp8 * self.scale).cpu())
        self.kl_unscaled.append(self._kl(ref, fp8).cpu())

    def figures(self) -> dict:
        """Agreement (all steps, and steps where the reference's top-1 probability is >= 0.5), mean KL."""
        agree, prob = torch.cat(self.agree).float(), torch.cat(self.top1_prob)
        confident = prob >= 0.5
        return {"top1_agreement": agree.mean().item(),
                "confident_agreement": agree[confident].mean().item() if confident.any() else None,
                "confident_steps": int(confident.sum()), "median_top1_prob": prob.median().item(),
                "kl_mean": torch.cat(self.kl).mean().item(),
                "kl_mean_unscaled": torch.cat(self.kl_unscaled).mean().item()}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
