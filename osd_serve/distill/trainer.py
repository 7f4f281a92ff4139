"""The distillation trainer: updates a private copy of the draft (LoRA via peft, or full fine-tune)
with AdamW on replay records, so serving never shares parameters with a model being trained.

Training data (GKD's lambda, Agarwal et al. 2023):
  teacher-sampled  the served responses: the target wrote them, and the records carry its
                   distributions at the kept positions. Costs no extra target forward.
  student-sampled  the student continues the record's prompt and the target scores every sampled
                   position (one target forward per record): on-policy, what the draft will see.
  mixed            each record is student-sampled with probability ``student_fraction``.
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kernels.fused_kl import chunked_forward_kl
from ..kv import max_input_id, pad_right
from .losses import LOSSES
from .replay import ReplayRecord

_EPS = 1e-12


@dataclass
class TrainConfig:
    mode: str = "full"  # full | lora
    lora_r: int = 16
    lora_alpha: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    steps_per_update: int = 16  # optimizer steps per update, on minibatches drawn from the shard
    batch_size: int = 8  # records per minibatch
    loss: str = "forward_kl"  # forward_kl | reverse_kl | jsd | tvd
    beta: float = 0.5  # for jsd
    student_fraction: float = 0.0  # 0 teacher-sampled, 1 student-sampled, between: mixed
    chunk_size: int = 0  # > 0: forward KL through the chunked/fused path, this many positions per chunk
    # Recency: this share of each minibatch comes from the newest `recent_window` records, the rest
    # uniformly from the whole buffer. After a shift the buffer is mostly the old domain; uniform
    # replay alone would adapt slowly, pure recency would forget.
    recent_fraction: float = 0.5
    recent_window: int = 64
    max_grad_norm: float = 1.0
    seed: int = 0
    # > 0: an update stops taking steps this many seconds after it began (the steps taken go to the guard
    # as any update's). A Ray Train job's workers stop together (any_rank); 0: no limit.
    time_limit_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("full", "lora"):
            raise ValueError(f"mode must be 'full' or 'lora', got {self.mode!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {self.loss!r}")
        if not 0.0 <= self.recent_fraction <= 1.0:
            raise ValueError(f"recent_fraction must be in [0, 1], got {self.recent_fraction}")
        if not 0.0 <= self.student_fraction <= 1.0:
            raise ValueError(f"student_fraction must be in [0, 1], got {self.student_fraction}")
        # Checked here, not in the losses: a replay failed only after its whole static run, and serving
        # only at the first update.
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")
        if self.chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0 (0: the plain loss), got {self.chunk_size}")
        if self.chunk_size and self.loss != "forward_kl":
            raise ValueError("chunk_size (the fused path) is implemented for loss='forward_kl' only")
        for name in ("lr", "steps_per_update", "batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not math.isfinite(self.lr):  # nan <= 0 is False: a NaN lr passed, and every step was NaN
            raise ValueError(f"lr must be finite, got {self.lr}")
        # 0 clipped every gradient to zero (training moved nothing, and each update published the same
        # weights again); NaN made every weight NaN. inf is no clipping.
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 (inf: no clipping), got {self.max_grad_norm}")
        if not (math.isfinite(self.time_limit_s) and self.time_limit_s >= 0):
            raise ValueError(f"time_limit_s must be >= 0 and finite (0: no limit), got {self.time_limit_s}")
        if self.recent_window < 1:  # records[-0:] is every record, records[-(-n):] all but the oldest n
            raise ValueError(f"recent_window must be >= 1 (recent_fraction 0: no recency), got {self.recent_window}")


def _student_positions(rec: ReplayRecord) -> torch.Tensor:
    """Indices into prompt+response whose logits predict the kept response tokens. [n]"""
    return len(rec.prompt_ids) - 1 + rec.positions


def any_rank(flag: bool, device=None) -> bool:
    """True on every rank of the default process group if it is True on any (one all-reduce of a flag)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([float(flag)], device=device)  # [1]
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class DistillTrainer:
    def __init__(self, draft, cfg: TrainConfig | None = None, teacher=None, vocab: int | None = None, grad_hook=None,
                 agree=None):
        """grad_hook(params), if given, runs after backward and before clipping: data-parallel
        workers all-reduce their gradients there (deployments/train_job.py). agree(late) -> bool, if
        given, turns each step's "past time_limit_s here" into one decision for all of them (any_rank):
        a worker that stopped alone left the others waiting in the all-reduce until it timed out."""
        self.grad_hook, self.agree = grad_hook, agree
        self.cfg = cfg or TrainConfig()
        if self.cfg.student_fraction > 0 and teacher is None:
            raise ValueError("student_fraction > 0 needs the teacher (target) model to score samples")
        self.teacher = teacher
        self.vocab = vocab or draft.get_output_embeddings().weight.shape[0]
        # The ids the student can put mass on: a draft with a smaller embedding than the target's
        # (Qwen2.5-0.5B for -7B: 151936 < 152064) learns the target's distribution over those.
        self.width = min(self.vocab, draft.get_output_embeddings().weight.shape[0])
        # the draft's own names and dtypes: what serving_state hands back (a full-mode student trains in float32)
        self._dtypes = {n: t.dtype for n, t in draft.state_dict().items()}
        self._template = draft
        self.student = self._build_student(None)
        self.device = next(self.student.parameters()).device
        self._rng = random.Random(self.cfg.seed)
        self._published = self._trainable_state()
        self.optimizer = self._new_optimizer()
        self.skipped_steps = 0  # steps not taken for a non-finite gradient
        self.time_limited = False  # the last train() stopped at time_limit_s

    def _build_student(self, state: dict | None):
        """A private copy of the draft (with ``state`` loaded), wrapped in a fresh LoRA in lora mode."""
        student = copy.deepcopy(self._template)
        if state is not None:
            student.load_state_dict(state, strict=False)
        if self.cfg.mode == "full" and any(p.dtype in (torch.bfloat16, torch.float16) for p in student.parameters()):
            # float32 master weights: AdamW on bfloat16 weights rounds away every step smaller than half a
            # ulp (at lr 1e-5, 85% of the weights never moved). serving_state casts back. (LoRA: peft keeps
            # its adapters in float32 already.)
            student = student.float()
        if self.cfg.mode == "lora":
            from peft import LoraConfig, get_peft_model

            lcfg = LoraConfig(r=self.cfg.lora_r, lora_alpha=self.cfg.lora_alpha, target_modules="all-linear")
            # peft draws lora_A from the global RNG: seeded here, every data-parallel rank (each builds its
            # own, deployments/train_job.py) starts from the same adapter whatever else drew before,
            # which averaging their gradients assumes; and the caller's RNG stream is left as it was.
            with torch.random.fork_rng():
                torch.manual_seed(self.cfg.seed)
                student = get_peft_model(student, lcfg)
        # Trained in eval mode: serving and the guard run the draft so, and the student that fits the
        # teacher under dropout is not the one that matches it there (a GPT-2 draft equal to its target
        # trained at loss 1.84 and left at alpha 0.94; dropout also drew from the global RNG). Not only
        # nn.Dropout modules: OPT, XGLM and BioGPT call functional dropout with a config float.
        return student.eval()

    def reset_to(self, state: dict[str, torch.Tensor]) -> None:
        """Restart from serving weights (a rollback): new student, new optimizer."""
        self.adopt(self.build_student(state))

    def build_student(self, state: dict[str, torch.Tensor]) -> tuple:
        """A new student from serving weights and its published point, for ``adopt``: every allocation
        reset_to makes (a copy of the draft, an upcast, peft, the float32 copy to revert to), so that
        a caller can build it before changing anything else. AdamW allocates its moments lazily."""
        student = self._build_student(state)
        return student, self._trainable_state(student)

    def adopt(self, built: tuple) -> None:
        self.student, self._published = built
        self.optimizer = self._new_optimizer()

    def _params(self):
        return [p for p in self.student.parameters() if p.requires_grad]

    def _new_optimizer(self):
        return torch.optim.AdamW(self._params(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    def _trainable_state(self, student=None) -> dict[str, torch.Tensor]:
        student = self.student if student is None else student
        return {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}

    # ---- batches ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _student_sampled(self, rec: ReplayRecord):
        """The student continues the prompt; the target scores every sampled position."""
        prompt = rec.prompt_ids.long()[None].to(self.device)
        n = max(len(rec.response_ids), 1)
        # A draft wider than the target (a padded embedding) must not sample ids the target cannot embed
        wide = list(range(self.vocab, self.student.get_output_embeddings().weight.shape[0]))
        # The draft's own distribution: every warper a checkpoint's generation_config may turn on is
        # turned off here (Qwen2.5-Instruct ships temperature 0.7, top_p 0.8, repetition_penalty 1.05,
        # which gave samples 0.40 in total variation from the draft's softmax)
        plain = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                 "eta_cutoff": 0.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
        out = self.student.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=True,
                                    pad_token_id=0, suppress_tokens=wide or None, **plain)
        seq = out[0]
        logits = self.teacher(seq[None].to(next(self.teacher.parameters()).device)).logits[0, :, : self.vocab]
        idx = torch.arange(len(rec.prompt_ids) - 1, len(seq) - 1)
        return seq.cpu(), idx, torch.softmax(logits[idx].float(), -1).cpu()

    def batch_loss(self, recs: list[ReplayRecord]) -> torch.Tensor:
        seqs, rows, idx, p = [], [], [], []
        for i, rec in enumerate(recs):
            if self.cfg.student_fraction and self._rng.random() < self.cfg.student_fraction:
                seq, ix, pr = self._student_sampled(rec)
            else:
                seq = torch.cat([rec.prompt_ids, rec.response_ids]).long()
                ix, pr = _student_positions(rec), rec.dense_probs(self.vocab)
            seqs.append(seq)
            rows.append(torch.full((len(ix),), i))
            idx.append(ix)
            p.append(pr)
        ids, mask = pad_right(seqs)  # right padding: kept positions never attend to it
        mask = mask.long()
        logits = self.student(input_ids=ids.clamp(max=max_input_id(self.student)).to(self.device), attention_mask=mask.to(self.device)).logits  # [B, L, V']
        rows_t, idx_t = torch.cat(rows).to(self.device), torch.cat(idx).to(self.device)
        # Rows come as wide as the target (full records), as the draft's vocab (student-sampled) or
        # up to the largest top-k id: cut to the ids both have, and renormalise what was cut. A draft
        # wider than the target (a padded embedding) is cut too, as serving cuts its logits (kv.fit_vocab).
        width = min(self.width, *(pr.shape[-1] for pr in p))
        student = logits[rows_t, idx_t, :width]  # [N, W]
        cut = any(pr.shape[-1] > width for pr in p)
        teacher_p = torch.cat([pr[:, :width] for pr in p]).to(self.device)  # [N, W]
        if cut:
            teacher_p = teacher_p / teacher_p.sum(-1, keepdim=True).clamp_min(_EPS)
        if self.cfg.chunk_size:
            return chunked_forward_kl(student, teacher_p, chunk_size=self.cfg.chunk_size)
        # The losses take teacher logits; log p is one (softmax(log p) = p). Zeros are clamped.
        teacher_logits = teacher_p.clamp_min(_EPS).log()
        if self.cfg.loss == "jsd":
            return LOSSES["jsd"](student, teacher_logits, beta=self.cfg.beta)
        return LOSSES[self.cfg.loss](student, teacher_logits)

    # ---- updates ---------------------------------------------------------------------------------
    def train(self, records: list[ReplayRecord], steps: int | None = None, progress: bool = False) -> list[float]:
        """Run ``steps`` AdamW steps on minibatches sampled from ``records``; returns their losses."""
        if not records:
            return []
        steps = steps or self.cfg.steps_per_update
        out, t0, limit = [], time.monotonic(), self.cfg.time_limit_s
        self.time_limited = False
        for _ in tqdm(range(steps), desc="distil", unit="step", disable=not progress, leave=False):
            if limit:  # checked by every worker at every step, so a collective agree() pairs up across them
                late = time.monotonic() - t0 > limit
                if self.agree(late) if self.agree is not None else late:
                    self.time_limited = True
                    break
            batch = self._minibatch(records)
            loss = self.batch_loss(batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.grad_hook is not None:
                self.grad_hook(self._params())
            norm = torch.nn.utils.clip_grad_norm_(self._params(), self.cfg.max_grad_norm)
            # A non-finite gradient (a minibatch with a bad record) would turn every weight into NaN
            # and the guard would then refuse the whole update: the step is skipped instead. The norm
            # is taken after grad_hook's all-reduce, so data-parallel workers all skip the same steps.
            if not torch.isfinite(norm):
                self.skipped_steps += 1
                continue
            self.optimizer.step()
            out.append(loss.item())
        return out

    def _minibatch(self, records: list[ReplayRecord]) -> list[ReplayRecord]:
        """records are oldest first; the recent share is drawn from the newest recent_window of them."""
        size = min(self.cfg.batch_size, len(records))
        n_recent = round(self.cfg.recent_fraction * size)
        recent = records[-self.cfg.recent_window :]
        batch = self._rng.sample(recent, min(n_recent, len(recent)))
        return batch + self._rng.sample(records, size - len(batch))

    def commit(self) -> None:
        """The guard published this student: it is the new point to revert to."""
        self._published = self._trainable_state()

    @torch.no_grad()
    def revert(self) -> None:
        """The guard refused the update: go back to the published weights and forget the moments."""
        for n, p in self.student.named_parameters():
            if n in self._published:
                p.copy_(self._published[n])
        self.optimizer = self._new_optimizer()

    @torch.no_grad()
    def serving_state(self) -> dict[str, torch.Tensor]:
        """The student as plain draft weights (names of ``draft.state_dict()``): LoRA is merged in,
        so the serving draft needs no peft and pays no adapter cost per forward."""
        if self.cfg.mode == "lora":
            merged = copy.deepcopy(self.student).merge_and_unload()
            state = merged.state_dict()
        else:
            state = self.student.state_dict()
        return {n: t.detach().to(self._dtypes[n]).clone().contiguous() for n, t in state.items() if n in self._dtypes}

    def save_adapter(self, path: str) -> None:
        """LoRA mode: the adapter in peft's format (adapter_model.safetensors), loadable by
        loading.attach_adapter and by the Ray Serve LoRA pool."""
        if self.cfg.mode == "lora":
            self.student.save_pretrained(path, safe_serialization=True)
