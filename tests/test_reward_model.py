"""The reward-model role: a tiny Qwen2ForSequenceClassification saved to disk, its scores against
transformers called directly, the config checks, and real runs that add its score to the reward."""

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from hybridrl.config import Config, load_config
from hybridrl.controller import WorkerContext
from hybridrl.driver.placement import build_roles
from hybridrl.rollout.reward_model import RewardModelClient, RewardModelWorker
from hybridrl.tasks import Prompt
from hybridrl.tasks.tokenizer import build_char_tokenizer

TINY_RUN = [  # tests/test_train_e2e.py's tiny run
    "sft.steps=3",
    "sft.batch_size=16",
    "task.eval_size=16",
    "trainer.prompts_per_step=4",
    "trainer.samples_per_prompt=2",
    "actor.ppo_minibatch_size=4",
    "trainer.total_steps=2",
    "trainer.eval_every=1",
    "trainer.save_every=1",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "controller.num_threads=1",
]
PAIRS = [
    ("12+34=", "46"),
    ("7-3=", "4"),
    ("100+200=", "300000"),
    ("1+1=", ""),
    ("99-98=", "1 1 1 1"),
]


def save_reward_model(path, pad: bool = True, **overrides):
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id if pad else None,
        **{"num_labels": 1, **overrides},
    )
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # a score head of visible size (the default init gives ~1e-2 logits)
        model.score.weight.mul_(50.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("rm") / "ckpt")


def cfg_with(tmp_path, *extra) -> Config:
    return load_config(
        Config,
        None,
        [
            *TINY_RUN,
            f"sft.checkpoint={tmp_path / 'ws'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
            *extra,
        ],
    )


def direct_scores(path, pairs) -> list[float]:
    """transformers on each pair alone, no padding."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [model(**tok(p + c, return_tensors="pt")).logits[0, 0].item() for p, c in pairs]


@pytest.mark.parametrize("pad,batch", [(True, 3), (True, 16), (False, 16)])
def test_scores_equal_transformers_one_pair_at_a_time(tmp_path, rm_path, pad, batch):
    path = rm_path if pad else save_reward_model(tmp_path / "nopad", pad=False)
    cfg = load_config(
        Config, None, [f"task.reward_model_path={path}", f"task.reward_model_batch_size={batch}"]
    )
    worker = RewardModelWorker(WorkerContext(0, 1, "reward_model", "global"), cfg)
    assert worker.batch_size == (batch if pad else 1)
    got = worker.score(PAIRS)
    want = direct_scores(path, PAIRS)
    assert got == pytest.approx(want, abs=1e-4, rel=1e-4)
    assert len(set(round(x, 3) for x in want)) == len(want)  # the pairs score differently
    # the Scorer's form: Prompt objects (their rendered text) and completions
    prompts = [
        Prompt(uid=f"p{i}", text=p, answer="", task_id="t") for i, (p, _) in enumerate(PAIRS)
    ]
    assert RewardModelClient(worker)(prompts, [c for _, c in PAIRS]) == got


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_on_the_gpu_and_host_memory_while_asleep(rm_path):
    cfg = load_config(Config, None, [f"task.reward_model_path={rm_path}"])
    worker = RewardModelWorker(WorkerContext(0, 1, "reward_model", "global"), cfg)
    weight = next(worker.model.parameters())
    assert weight.device.type == "cuda" and weight.dtype == torch.bfloat16
    want = direct_scores(rm_path, PAIRS)
    assert worker.score(PAIRS) == pytest.approx(want, rel=0.05, abs=0.25)
    worker.sleep()  # colocated: another role has the device
    assert next(worker.model.parameters()).device.type == "cpu"
    assert worker.score(PAIRS) == pytest.approx(want, rel=0.05, abs=0.25)  # woke up for it
    assert next(worker.model.parameters()).device.type == "cuda"


def test_config_errors(tmp_path, rm_path):
    def load(*extra):
        return load_config(Config, None, list(extra))

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no config.json"):
        load(f"task.reward_model_path={empty}")
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ValueError, match="not a sequence-classification model"):
        load(f"task.reward_model_path={causal}")
    two = save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match="has 2 labels"):
        load(f"task.reward_model_path={two}")
    with pytest.raises(ValueError, match="task.reward_model_path is null"):
        load("controller.placement={learner: global, rollout: global, reward_model: global}")
    with pytest.raises(ValueError, match="names pool 'rm', which is not in pools"):
        load(
            f"task.reward_model_path={rm_path}",
            "controller.placement={learner: global, rollout: global, reward_model: rm}",
        )
    with pytest.raises(ValueError, match="placement.reward_model shares the learner's pool"):
        load(
            f"task.reward_model_path={rm_path}",
            "trainer.mode=async",
            "controller.backend=ray",
            "controller.pools={train: {}, gen: {}}",
            "controller.placement={learner: train, rollout: gen, reward_model: train}",
        )
    cfg = load(f"task.reward_model_path={rm_path}")  # unplaced: the rollout's pool
    assert "reward_model" not in cfg.controller.placement
    assert cfg.controller.pool_of("reward_model") == cfg.controller.placement["rollout"]


def zero_reward(tmp_path) -> str:
    """A task.reward_fn that scores every sample 0, by file path."""
    (tmp_path / "rewards.py").write_text("def zero(prompt, response):\n    return 0.0\n")
    return f"task.reward_fn={tmp_path / 'rewards.py'}:zero"


def rows_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_reward_is_the_models(rows, steps):
    for step in steps:
        row = next(r for r in rows if r["step"] == step)
        assert row["reward/reward_model"] != 0.0
        # task.reward_fn scores 0: the reward is the reward model's score (weight 1)
        assert row["reward/mean"] == pytest.approx(row["reward/reward_model"], abs=1e-5)


def test_local_run_adds_the_models_score(tmp_path, rm_path):
    from hybridrl.driver.loop import train

    cfg = cfg_with(
        tmp_path,
        f"task.reward_model_path={rm_path}",
        zero_reward(tmp_path),
        "task.reward_model_batch_size=3",
    )
    roles = build_roles(cfg, None, None, learner=False)
    try:  # the local backend: the rollout's Scorer calls the worker object itself
        assert roles.reward_model.world_size == 1 and roles.reward_model.backend_name == "local"
        scorer = roles.rollout.workers[0].scorer
        assert [f.name for f in scorer.functions][-1] == "reward_model"
    finally:
        roles.shutdown()
    assert train(cfg)["steps"] == 2
    check_reward_is_the_models(rows_of(tmp_path / "runs" / "arith_grpo"), [1, 2])


def test_local_async_run_scores_in_the_stream(tmp_path, rm_path):
    from hybridrl.driver.loop import train

    cfg = cfg_with(
        tmp_path,
        f"task.reward_model_path={rm_path}",
        zero_reward(tmp_path),
        "trainer.mode=async",
        "trainer.eval_every=0",
    )
    assert train(cfg)["steps"] == 2
    check_reward_is_the_models(rows_of(tmp_path / "runs" / "arith_grpo"), [1, 2])


@pytest.fixture(scope="module")
def ray_cluster():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.mark.distributed
def test_ray_colocated_with_the_rollout_scores_in_memory(tmp_path, rm_path, ray_cluster):
    """Under Ray, unplaced: the reward model shares the rollout's processes (one colocated group)
    and the rollout's Scorer calls it there; its scores equal the role's own."""
    from hybridrl.controller.colocated import RoleView
    from hybridrl.models.loading import load_tokenizer, make_task
    from hybridrl.protocol import prompt_sample
    from hybridrl.rollout import SamplingParams

    cfg = cfg_with(
        tmp_path,
        f"task.reward_model_path={rm_path}",
        zero_reward(tmp_path),
        "controller.backend=ray",
    )
    roles = build_roles(cfg, None, None, learner=False)
    try:
        assert isinstance(roles.reward_model, RoleView) and isinstance(roles.rollout, RoleView)
        assert roles.reward_model.group is roles.rollout.group
        tok = load_tokenizer(cfg, None)
        prompts = make_task(cfg).heldout()[:3]
        samples = roles.rollout.generate(
            [prompt_sample(p, tok) for p in prompts], SamplingParams.of(cfg, n=2)
        )
        pairs = [
            (s.metadata["prompt"].text, tok.decode(s.response_ids, skip_special_tokens=True))
            for s in samples
        ]
        want = roles.reward_model.score(pairs)
    finally:
        roles.shutdown()
    # the rollout scores each group as it finishes, the check scores all pairs in one batch: the
    # same model on other batch shapes, equal to float rounding
    assert [s.reward for s in samples] == pytest.approx(want, abs=1e-5)
    logged = [s.reward_extras["reward/reward_model"] for s in samples]
    assert logged == pytest.approx(want, abs=1e-5)


@pytest.mark.slow  # a Ray run on two pools (~17 s); the colocated Ray test stays fast
def test_ray_run_with_the_reward_model_on_its_own_pool(tmp_path, rm_path, ray_cluster):
    from hybridrl.driver.loop import train

    cfg = cfg_with(
        tmp_path,
        f"task.reward_model_path={rm_path}",
        zero_reward(tmp_path),
        "trainer.eval_every=0",
        "controller.backend=ray",
        "controller.pools={global: {cpus_per_worker: 0.5}, rm: {cpus_per_worker: 0.5}}",
        "controller.placement={learner: global, rollout: global, reward_model: rm}",
    )
    assert train(cfg)["steps"] == 2
    check_reward_is_the_models(rows_of(tmp_path / "runs" / "arith_grpo"), [1, 2])
