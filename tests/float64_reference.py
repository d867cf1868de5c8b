"""transformers as a float64 reference: the steps it computes in float32 even for a float64 model — RMSNorm, the RoPE
angles, a MoE router's softmax — patched to run in the model's dtype, so that comparisons can be at 1e-10."""
import torch


def rms_norm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def rotary(self, x, position_ids):
    D = 2 * self.inv_freq.numel()
    inv_freq = 1.0 / self.config.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def softmax_top_k(self, hidden_states):
    """Mixtral's and Qwen3-MoE's router: softmax over the experts, top-k, renormalized unless norm_topk_prob is off."""
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True) if getattr(self, "norm_topk_prob", True) else top, chosen


def float64_steps(monkeypatch, norm, rotary_embedding, router=None):
    """Patch a model family's RMSNorm, rotary embedding and (softmax top-k) router classes."""
    monkeypatch.setattr(norm, "forward", rms_norm)
    monkeypatch.setattr(rotary_embedding, "forward", rotary)
    if router is not None:
        monkeypatch.setattr(router, "forward", softmax_top_k)
