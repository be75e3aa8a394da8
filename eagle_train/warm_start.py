"""Warm start: a new draft head whose output side is the target's own.

The head's last two modules do what the target's last two do: `norm` then `lm_head`, the latter over
the draft vocabulary only. Copying the target's final norm weight and its lm_head rows of the draft
ids (draft id j is target id j + d2t[j]) makes the head read its pre-norm output the way the target
reads its last hidden state, so training starts from a head whose logits are the target's, restricted
to the draft vocabulary, as soon as its layer reproduces the target's last hidden state.
"""

import torch


@torch.no_grad()
def warm_start_from_target(head, target_model) -> None:
    """Set `head.lm_head` to the target's lm_head rows of the draft vocabulary and `head.norm` to the
    target's final norm weight, in place. Call it after the head's vocab map (d2t) is set."""
    target_ids = head.draft_to_target_ids(torch.arange(head.config.draft_vocab_size, device=head.d2t.device))
    lm_head = target_model.get_output_embeddings().weight
    norm = target_model.model.norm.weight  # the decoder stack check_decoder requires at model.model
    if lm_head.shape[1] != head.lm_head.weight.shape[1] or norm.shape != head.norm.weight.shape:
        raise ValueError(
            f"the target's lm_head {tuple(lm_head.shape)} and final norm {tuple(norm.shape)} do not "
            f"fit the head's lm_head {tuple(head.lm_head.weight.shape)}: the head was built for another "
            "target"
        )
    check_plain_rms_norm(target_model.model.norm, head)
    if not head.borrows_lm_head:  # a borrowed lm_head is the target's already
        head.lm_head.weight.copy_(lm_head[target_ids.to(lm_head.device)])
    head.norm.weight.copy_(norm)


def check_plain_rms_norm(target_norm, head) -> None:
    """Refuse, in one line, a target whose final norm is not x / rms(x) * weight (Gemma's x / rms(x) * (1 + weight),
    a LayerNorm): its weight copied into the head's RMSNorm would start the head from another function."""
    x = torch.randn(4, head.norm.weight.shape[0], generator=torch.Generator().manual_seed(0))
    x = x.to(target_norm.weight.device, target_norm.weight.dtype)
    plain = (
        x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + head.norm.eps) * target_norm.weight.float()
    )
    if not torch.allclose(target_norm(x).float(), plain, rtol=1e-2, atol=1e-4):
        raise ValueError(
            f"warm_start copies the target's final norm weight into the head's RMSNorm, but this target's "
            f"{type(target_norm).__name__} does not scale by that weight alone: train without warm_start"
        )
