"""fla's chunked gated delta rule called below its autograd wrapper.

fla-core 0.4's `chunk_gated_delta_rule` is a training API: an autograd Function whose forward runs under
`input_guard` (every input made contiguous, the device switched in and out) and `custom_fwd`, and saves
its inputs for a backward that serving never runs. A cold prefill step calls it twice per linear layer,
and that Python runs on the host between kernel launches of a step whose time is the host's. `direct`
calls fla's own forward (`chunk_gated_delta_rule_fwd`: the same kernels in the same order, so the same
numbers) with the inputs made contiguous as input_guard makes them, and returns what the public call
returns. Where that forward is missing or takes other parameters (another fla version), the public call
is used as it is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

# what `direct` passes by name to fla's forward
FORWARD_PARAMETERS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens")


def direct(public: Callable[..., tuple[torch.Tensor, torch.Tensor]],
           forward: Callable[..., tuple] | None) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A chunked rule with `public`'s contract (DeltaRuleKernels.chunk) that calls `forward` (fla's
    chunk_gated_delta_rule_fwd: (g, o, A, final_state)) where it can: inputs normalised by the caller
    (use_qk_l2norm_in_kernel False). `public` where forward is None or its parameters are not fla 0.4's."""
    if forward is None or not _takes(forward, FORWARD_PARAMETERS):
        return public

    def chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if use_qk_l2norm_in_kernel:  # fla's l2norm runs in the wrapper
            return public(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=True,
                          cu_seqlens=cu_seqlens)
        _, o, _, final_state = forward(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(), beta=beta.contiguous(),
            scale=k.shape[-1] ** -0.5 if scale is None else scale,
            initial_state=None if initial_state is None else initial_state.contiguous(),
            output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        return o.to(q.dtype), final_state

    chunk.forward = forward
    return chunk


def _takes(fn: Callable, names: tuple[str, ...]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(name in parameters for name in names)
