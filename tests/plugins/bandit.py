"""A third policy family, defined outside Tether as a user would: a contextual bandit.

A prompt names one of ``ARMS`` arms ("arm 3"); a sample is one pull; the reward is 1 when the
pulled arm is the named one. The policy is a table of logits, one row per prompt. One module and
one ``register_family`` call (plus its task): ``run.plugins: [tests/plugins/bandit.py]`` makes
``model.family: bandit`` and ``data.task: arms`` valid, in every process of the run.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

import tether
from tether.data.rewards import Scorer, score_all
from tether.rollout.model_engine import ModelEngine
from tether.vocabulary import Capabilities, DataBundle, Example, WorkItem, version_shares

ARMS = 8


class BanditModel(torch.nn.Module):
    """Logits over the arms for each prompt (``rows`` of them)."""

    def __init__(self, rows: int = ARMS) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(rows, ARMS))

    def forward(self, prompts: torch.Tensor) -> torch.Tensor:
        return self.logits[prompts]  # (N, ARMS)

    def save_pretrained(self, folder: Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"tether_family": "bandit", "rows": len(self.logits)}))
        from safetensors.torch import save_file

        save_file({"logits": self.logits.detach().contiguous()}, str(folder / "model.safetensors"))

    @classmethod
    def from_pretrained(cls, folder: Path) -> BanditModel:
        from safetensors.torch import load_file

        model = cls(json.loads((Path(folder) / "config.json").read_text())["rows"])
        model.logits.data.copy_(load_file(str(Path(folder) / "model.safetensors"))["logits"])
        return model


def arm_of(prompt: str) -> int:
    return int(prompt.split()[1])


@dataclass(frozen=True)
class Arms:
    """The task: which arm to pull. There are only ``ARMS`` prompts, so the held-out split asks
    the same questions as the training one, in another order."""

    name: str = "arms"
    description: str = "pull the arm the prompt names (a contextual bandit)"
    family: str = "bandit"
    difficulties: tuple[int, ...] = (1,)
    default_difficulty: int = 1
    stop: str = ""

    def examples(self, split: str, n: int, *, seed: int = 0, difficulty: int | None = None) -> list[Example]:
        rng = random.Random(f"arms/{split}/{seed}")
        return [Example(prompt=f"arm {a}", answer=str(a)) for a in (rng.randrange(ARMS) for _ in range(n))]

    def verify(self, prompt: str, pulled: str, answer: str, fields) -> float:
        return float(pulled == answer)


@dataclass
class Pulls:
    """The payload: B prompts × G pulls, each one action with its log-probability and version."""

    prompts: list[int]
    arms: list[int]
    logprobs: list[float]
    versions: list[list[int]]
    rewards: list[float]
    group_size: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.prompts)

    def check(self) -> None:
        n = self.num_groups * self.group_size
        if not len(self.arms) == len(self.logprobs) == len(self.versions) == len(self.rewards) == n:
            raise ValueError(f"a bandit batch of {self.num_groups} groups of {self.group_size} is not whole")

    def version_shares(self) -> dict[int, float]:
        return version_shares(self.versions)

    def sample_lines(self) -> list[dict]:
        return [{"prompt": self.prompts[i // self.group_size], "arm": a, "reward": r}
                for i, (a, r) in enumerate(zip(self.arms, self.rewards, strict=True))]


class BanditEngine(ModelEngine):
    def pull(self, prompts: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logp = torch.log_softmax(self.model(prompts), -1)  # (N, ARMS)
        arms = torch.multinomial(logp.exp(), 1, generator=torch.Generator().manual_seed(seed))[:, 0]
        return arms, logp.gather(1, arms[:, None])[:, 0]


class BanditSampler:
    def __init__(self, cfg, model_path: str) -> None:
        self.cfg = cfg
        self.engine = BanditEngine(BanditModel.from_pretrained(Path(model_path)))
        self.score = cfg.family().scorer(cfg)

    def close(self) -> None:
        """Nothing to release besides the engine."""

    def generate(self, item: WorkItem) -> Pulls:
        t0 = time.perf_counter()
        g = item.group_size
        prompts = [arm_of(ex.prompt) for _, ex in item.examples]
        arms, logp = self.engine.pull(torch.tensor(prompts).repeat_interleave(g), item.seed)
        pairs = [(item.examples[i // g][1], str(int(a))) for i, a in enumerate(arms)]
        rewards, errors = score_all(self.score, pairs, on_error=self.cfg.reward.on_error)
        mean = sum(rewards) / len(rewards)
        return Pulls(prompts=prompts, arms=arms.tolist(), logprobs=logp.tolist(),
                     versions=[[self.engine.version] for _ in rewards], rewards=rewards, group_size=g,
                     metrics={"reward/mean": mean, "reward/errors": float(errors),
                              "time/generate": time.perf_counter() - t0})


@dataclass(frozen=True)
class PullTensors:
    """A batch as the learner sees it: one column per sample, its pull."""

    prompts: torch.Tensor  # (N,)
    arms: torch.Tensor  # (N,)
    mask: torch.Tensor  # (N, 1)
    behavior_logp: torch.Tensor  # (N, 1)
    behavior_versions: torch.Tensor  # (N, 1)
    rewards: torch.Tensor  # (N,)
    truncated: torch.Tensor  # (N,)
    group_size: int
    episode: None = None  # a sample is one row

    @property
    def size(self) -> int:
        return len(self.prompts)

    def rows(self, index) -> PullTensors:
        return replace(self, prompts=self.prompts[index], arms=self.arms[index], mask=self.mask[index],
                       behavior_logp=self.behavior_logp[index],
                       behavior_versions=self.behavior_versions[index],
                       rewards=self.rewards[index], truncated=self.truncated[index])

    def to(self, device) -> PullTensors:
        return self


class BanditPolicy(tether.PolicyBase):
    def load(self, path):
        return BanditModel.from_pretrained(Path(path)), None

    def save(self, model, tokenizer, folder: Path) -> None:
        model.save_pretrained(folder)

    def batch(self, pulls: Pulls) -> PullTensors:
        n = len(pulls.arms)
        return PullTensors(prompts=torch.tensor(pulls.prompts).repeat_interleave(pulls.group_size),
                           arms=torch.tensor(pulls.arms), mask=torch.ones(n, 1),
                           behavior_logp=torch.tensor(pulls.logprobs)[:, None],
                           behavior_versions=torch.tensor(pulls.versions),
                           rewards=torch.tensor(pulls.rewards),
                           truncated=torch.zeros(n, dtype=torch.bool), group_size=pulls.group_size)

    def forward(self, model, batch: PullTensors, *, with_entropy: bool = False, forward=None):
        logp_all = torch.log_softmax(model(batch.prompts), -1)  # (n, ARMS)
        logp = logp_all.gather(1, batch.arms[:, None])  # (n, 1)
        entropy = -(logp_all.exp() * logp_all).sum(-1, keepdim=True) if with_entropy else None
        return logp, entropy, logp

    def kl(self, basis, ref_basis, estimator: str):
        from tether import registry

        return registry.kl_estimators.get(estimator)(basis, ref_basis)

    def fast_forward(self, model, enabled: bool):
        return None

    def layers(self, model) -> list:
        return []  # a table of logits: no blocks to shard or recompute


class Greedy:
    """Held-out pass@1: the most likely arm of each prompt."""

    def __init__(self, model: BanditModel, data: DataBundle) -> None:
        self.model, self.examples = model, data.eval

    def __call__(self, step: int) -> dict[str, float]:
        with torch.no_grad():
            best = self.model(torch.tensor([arm_of(e.prompt) for e in self.examples])).argmax(-1)
        right = sum(int(b) == arm_of(e.prompt) for b, e in zip(best, self.examples, strict=True))
        return {"eval/pass_at_1": right / len(self.examples), "eval/examples": float(len(self.examples))}


class BanditFamily(tether.FamilyBase):
    name = "bandit"
    description = "a contextual bandit: a sample is one pull"
    capabilities = Capabilities(engine_kind="step", backends=("local",), inflight_updates=("drain",))

    def norm_constant(self, cfg) -> int:
        return 1

    def build_model(self, cfg, out: Path, on_progress) -> str:
        torch.manual_seed(cfg.run.seed)
        BanditModel().save_pretrained(out)
        return f"built a bandit of {ARMS} arms (uniform)"

    def scorer(self, cfg):
        return Scorer(ARMS_TASK.verify, "arms")

    def data(self, cfg, model_path: Path) -> DataBundle:
        task = ARMS_TASK
        return DataBundle(train=task.examples("train", cfg.data.num_train, seed=cfg.run.seed),
                          eval=task.examples("eval", cfg.data.num_eval, seed=cfg.run.seed), stop_text="",
                          skipped_long_prompts=0, description="task arms")

    def sampler(self, cfg, model_path: str, stop_text: str, *, device, threads: int, seed: int):
        return BanditSampler(cfg, model_path)

    def policy(self, cfg):
        return BanditPolicy()

    def evaluator(self, cfg, model, tokenizer, data, score, *, num_samples=None, run_dir=None):
        return Greedy(model, data)


ARMS_TASK = Arms()
tether.register_task(ARMS_TASK)
FAMILY = tether.register_family(BanditFamily())
