"""Training and evaluation of the bootstrap pair's language models, on CPU: next-token and
distillation training, held-out loss, the target's greedy continuations (the draft's distillation
data) and static greedy acceptance. `bootstrap.py` decides what to train; this file how."""

from __future__ import annotations

import functools
import math
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from .bootstrap import TrainSchedule


def _cpu_has_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def use_bf16_autocast() -> bool:
    """Whether training and the target's continuations run under bf16 autocast: only where the
    CPU has native bf16 *and* it is measurably faster here. Native bf16 is not enough: with AMX,
    bf16 matmuls ran ~1.6x faster than fp32, but on an AVX512-BF16 host without AMX a training step
    was ~1.6x *slower* (target 1.46 vs 0.90 s), which pushed the default build from ~9 to ~16
    minutes. So time one training-shaped linear, forward and backward, both ways (~0.5 s, once per
    process), and keep fp32 unless bf16 wins by 10%."""
    if not _cpu_has_bf16():
        return False

    def step_time(bf16: bool) -> float:
        x = torch.randn(1024, 512, requires_grad=True)  # [tokens, hidden]: a batch of 4 x 256
        w = torch.randn(1408, 512, requires_grad=True)  # [intermediate, hidden]: the target's MLP
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = F.linear(x, w)  # [tokens, intermediate]
        y.float().sum().backward()
        return time.perf_counter() - t0

    # Interleaved, best of 8 each after 2 warm-ups: right after the models are built the first
    # fp32 calls ran 1.7-3x slower than their steady state, which once tipped a single median
    # the wrong way (fp32 38.8 vs bf16 29.0 ms, where steady fp32 is ~17 ms).
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.inference_mode(False), torch.enable_grad():  # the first caller may be under no_grad
        for i in range(10):
            for bf16 in (False, True):
                t = step_time(bf16)
                if i >= 2:
                    times[bf16].append(t)
    fp32, bf16 = min(times[False]), min(times[True])
    print(f"[bootstrap] bf16 autocast {'on' if bf16 < 0.9 * fp32 else 'off'}: a training-shaped matmul takes "
          f"{bf16 * 1e3:.1f} ms in bf16, {fp32 * 1e3:.1f} ms in fp32", file=sys.stderr)
    return bf16 < 0.9 * fp32


def _autocast():
    """bf16 matmuls (fp32 master weights) where they are faster on this CPU, else a no-op."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16_autocast())


@torch.no_grad()
def teacher_log_probs(teacher, windows: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """The teacher's next-token log-probabilities over fixed windows [n, seq_len] -> [n, seq_len, vocab],
    computed once: the 30M target's forward was ~85% of a distillation step's time, and distilling
    over the same windows again then costs only the 1.2M draft's forward and backward."""
    autocast = _autocast()
    out = []
    for i in tqdm(range(0, len(windows), batch), desc="teacher soft labels", unit="batch"):
        with autocast:
            logits = teacher(input_ids=windows[i : i + batch]).logits  # [b, seq_len, vocab]
        out.append(F.log_softmax(logits.float(), -1))
    return torch.cat(out)


def train_lm(model, stream: torch.Tensor, seq_len: int, sched: TrainSchedule, seed: int, desc: str,
             teacher=None) -> float:
    """AdamW on windows of `stream`: next-token cross-entropy on random windows, or with a `teacher`,
    KL(teacher || model) on its soft labels, over the stream cut into consecutive windows whose
    labels are computed once (`teacher_log_probs`). Returns the smoothed final loss."""
    gen = torch.Generator().manual_seed(seed)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]  # norm gains
    opt = torch.optim.AdamW(groups, lr=sched.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:  # linear warmup, cosine to 10%
        if step < sched.warmup:
            return sched.lr * (step + 1) / sched.warmup
        t = (step - sched.warmup) / max(1, sched.steps - sched.warmup)
        return sched.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))

    if len(stream) <= seq_len:
        raise ValueError(f"corpus has {len(stream)} tokens, not more than seq_len={seq_len}")
    if teacher is not None:
        windows = stream[: len(stream) // seq_len * seq_len].view(-1, seq_len)  # [n, seq_len]
        soft = teacher_log_probs(teacher, windows)  # [n, seq_len, vocab]
    autocast = _autocast()
    model.train()
    ema = None
    bar = tqdm(range(sched.steps), desc=desc, unit="step")
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        if teacher is None:
            starts = torch.randint(0, len(stream) - seq_len, (sched.batch,), generator=gen)
            batch = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])  # [batch, seq_len]
        else:
            rows = torch.randint(0, len(windows), (sched.batch,), generator=gen)
            batch = windows[rows]  # [batch, seq_len]
        with autocast:
            logits = model(input_ids=batch).logits.float()  # [batch, seq_len, vocab]
        if teacher is None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        else:
            # batchmean over the flattened tokens = mean per-token KL.
            loss = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1), soft[rows].flatten(0, 1),
                            log_target=True, reduction="batchmean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    model.eval()
    return float(ema)


@torch.inference_mode()
def eval_loss(model, stream: torch.Tensor, seq_len: int, n_windows: int = 8) -> float:
    """Mean next-token loss on windows spread evenly over a held-out stream."""
    seq_len = min(seq_len, len(stream))
    starts = torch.linspace(0, len(stream) - seq_len, n_windows).long().unique().tolist()
    batch = torch.stack([stream[s : s + seq_len] for s in starts])  # [n_windows, seq_len]
    return float(model(input_ids=batch, labels=batch).loss)


@torch.no_grad()  # not inference_mode: the returned stream is training data for autograd
def greedy_continuations(target, tokenizer, prompts: list[str], new_tokens: int, batch: int = 32) -> torch.Tensor:
    """The target's greedy continuation of each prompt, as one token stream [n_tokens] of
    prompt + continuation + EOS per prompt: the distillation data the draft is judged on."""
    from .kv import pad_left  # imports transformers: not at module level, so a cached bootstrap stays fast

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    ids: list[int] = []
    autocast = _autocast()
    for i in tqdm(range(0, len(prompts), batch), desc="target continuations", unit="batch"):
        rows = [tokenizer(p)["input_ids"] for p in prompts[i : i + batch]]
        inp, mask = pad_left(rows, pad)  # [b, width]
        with autocast:
            out = target.generate(inp, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=pad)  # [b, width + new_tokens]
        for r, row in zip(rows, out[:, inp.shape[1] :].tolist()):
            ids += r + row + [eos]
    return torch.tensor(ids, dtype=torch.long)


@torch.inference_mode()
def greedy_acceptance(target, draft, tokenizer, prompts: list[str], new_tokens: int) -> float:
    """Static greedy acceptance: the fraction of positions on the target's own greedy
    continuation where argmax(draft) equals argmax(target) (= the continuation token)."""
    agree = total = 0
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])  # [1, prompt_len]
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=tokenizer.pad_token_id)  # [1, prompt_len + new]
        cont = out[0, ids.shape[1] :]
        # Logits at position i predict token i+1, so the slice ending one before the last token
        # scores exactly the continuation.
        logits = draft(input_ids=out).logits[0, ids.shape[1] - 1 : -1]  # [new_tokens, vocab]
        agree += int((logits.argmax(-1) == cont).sum())
        total += len(cont)
    return agree / max(1, total)
