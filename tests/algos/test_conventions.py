"""The published conventions, each against an independent computation from its formula.

Hand-made tensors and numbers; the reference values are written out here from the papers'
and official code's formulas (float64, the standard library), never through digen's own path.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from digen.algos.rollout import SamplerSpec, sample_rollout
from digen.algos.sde import sde_step
from digen.config import load_config
from digen.registry.algos import ALGO_NAMES, get_algorithm

SIGMAS = torch.tensor([1.0, 0.9, 0.75, 0.55, 0.3, 0.0])


def _tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))


def test_cps_published_log_prob_is_minus_mean_squared_error() -> None:
    x, v, x_next = _tensors()
    out = sde_step("cps", v, x, SIGMAS, 2, 0.8, prev_sample=x_next, log_prob="mse")
    s, s1 = 0.75, 0.55
    std = s1 * math.sin(0.8 * math.pi / 2)
    x0, x1 = x.double() - s * v.double(), x.double() + (1 - s) * v.double()
    mean = x0 * (1 - s1) + x1 * math.sqrt(s1**2 - std**2)
    want = -((x_next.double() - mean) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), want, rtol=1e-5, atol=1e-6)
    # its log-ratios are the Gaussian ones times 2 std^2: a clip range means 2 std^2 more
    other = x_next + 0.01
    gauss = [
        sde_step("cps", v, x, SIGMAS, 2, 0.8, prev_sample=p, log_prob="gaussian").log_prob
        for p in (x_next, other)
    ]
    mse = [
        sde_step("cps", v, x, SIGMAS, 2, 0.8, prev_sample=p, log_prob="mse").log_prob
        for p in (x_next, other)
    ]
    torch.testing.assert_close(
        (mse[0] - mse[1]).double(),
        2 * std**2 * (gauss[0] - gauss[1]).double(),
        rtol=1e-3,
        atol=1e-7,
    )


def test_cps_log_prob_form_follows_the_config() -> None:
    flow = get_algorithm("flowgrpo")
    published = load_config(overrides=["rollout.sde_type=cps"])
    gaussian = load_config(overrides=["rollout.sde_type=cps", "rollout.cps_logprob=gaussian"])
    assert published.rollout.cps_logprob == "published"  # the default
    assert flow.log_prob_form("cps", published) == "mse"
    assert flow.log_prob_form("cps", gaussian) == "gaussian"
    assert flow.log_prob_form("sde", published) == "gaussian"


@pytest.mark.parametrize("i", [0, 2, 4])
def test_kl_flowgrpo_divides_by_std_dev_t_squared_exact_by_the_step_variance(i: int) -> None:
    x, v, v_ref = _tensors(i)
    a = 0.7
    out = sde_step("sde", v, x, SIGMAS, i, a, prev_sample=x)
    ref = sde_step("sde", v_ref, x, SIGMAS, i, a, prev_sample=x)
    s, s1 = float(SIGMAS[i]), float(SIGMAS[i + 1])
    s_t = a * math.sqrt(s / (1 - (float(SIGMAS[1]) if s == 1.0 else s)))
    sq = ((out.mean.double() - ref.mean.double()) ** 2).mean(dim=(1, 2, 3))
    algo = get_algorithm("flowgrpo")
    published = load_config().algo  # flowgrpo's default kl_type: its own convention
    exact = load_config(overrides=["algo.kl_type=exact"]).algo
    assert published.resolved_kl_type == "flowgrpo"
    kl_published = algo.kl(published, out.mean, ref.mean, out).double()
    kl_exact = algo.kl(exact, out.mean, ref.mean, out).double()
    torch.testing.assert_close(kl_published, sq / (2 * s_t**2), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(kl_exact, sq / (2 * s_t**2 * (s - s1)), rtol=1e-5, atol=1e-9)


def test_advantage_std_conventions() -> None:
    rewards = [[1.0, 2.0, 3.0, 5.0], [10.0, 10.0, 11.0, 14.0]]
    t = torch.tensor(rewards)
    # Flow-GRPO: per-prompt mean, one population std over the batch, + 1e-4
    flow = load_config(overrides=["algo.adv_std=global"]).algo
    adv, _ = get_algorithm("flowgrpo").advantages(t, flow)
    pooled = statistics.pstdev([r for row in rewards for r in row])
    for g, row in enumerate(rewards):
        mean = statistics.fmean(row)
        want = [max(-5.0, min(5.0, (r - mean) / (pooled + 1e-4))) for r in row]
        assert adv[g].tolist() == pytest.approx(want, rel=1e-6)
    # DanceGRPO: per group, unbiased std, + 1e-8
    dance = load_config(algo="dancegrpo").algo
    assert (dance.adv_std, dance.adv_std_unbiased, dance.adv_eps) == ("group", True, 1e-8)
    adv, keep = get_algorithm("dancegrpo").advantages(t, dance)
    for g, row in enumerate(rewards):
        mean, sd = statistics.fmean(row), statistics.stdev(row)
        assert adv[g].tolist() == pytest.approx([(r - mean) / (sd + 1e-8) for r in row], rel=1e-6)
    assert bool(keep.all())


def _fake_adapter(shape=(3, 4)):
    class _Fake:
        def initial_latents(self, generators):
            return torch.stack([torch.randn(shape, generator=g) for g in generators])

        def predict_velocity(self, x, sigma, cond, neg, guidance):
            return 0.5 * x + torch.as_tensor(sigma, dtype=x.dtype).reshape(-1, *[1] * (x.ndim - 1))

    return _Fake()


def _velocity(x: torch.Tensor, s: float) -> torch.Tensor:
    return 0.5 * x + s


def test_dancegrpo_decodes_the_last_clean_prediction_and_trains_steps_before_it() -> None:
    cfg = load_config(algo="dancegrpo", overrides=["rollout.num_inference_steps=5"])
    plan = get_algorithm("dancegrpo").noisy_steps(cfg, 0)
    assert plan.stochastic == plan.trainable == (0, 1, 2, 3)  # steps 0 .. N-2
    eta = cfg.rollout.noise_level
    spec = SamplerSpec(
        sigmas=SIGMAS,
        window=plan.trainable,
        sde_type="dance",
        noise_level=eta,
        stochastic=plan.stochastic,
    )
    gens = [torch.Generator().manual_seed(7)]
    ro = sample_rollout(_fake_adapter(), None, gens, spec)
    # replay from the formulas: the same generator draws the latent, then one noise a step
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, generator=g).double()
    for i in range(4):
        s, s1 = float(SIGMAS[i]), float(SIGMAS[i + 1])
        v = _velocity(x, s)
        x0 = x - s * v
        mean = x + (s1 - s) * v + (s1 - s) * (eta**2 / 2) * (x - (1 - s) * x0) / s**2
        x = mean + eta * math.sqrt(s - s1) * torch.randn(3, 4, generator=g).double()
    decoded = x - float(SIGMAS[4]) * _velocity(x, float(SIGMAS[4]))  # clean prediction
    torch.testing.assert_close(ro.final[0].double(), decoded, rtol=1e-5, atol=1e-5)
    assert ro.latents.shape[1] == 4  # the last step's transition is not kept


def test_flowgrpo_plans_every_step_noisy_and_all_but_the_last_trained() -> None:
    flow = get_algorithm("flowgrpo")
    cfg = load_config(overrides=["rollout.num_inference_steps=6"])
    assert flow.noisy_steps(cfg, 0).stochastic == (
        0,
        1,
        2,
        3,
        4,
        5,
    )  # its last step's noise is decoded
    assert flow.noisy_steps(cfg, 0).trainable == (0, 1, 2, 3, 4)
    cps = load_config(overrides=["rollout.num_inference_steps=6", "rollout.sde_type=cps"])
    assert flow.noisy_steps(cps, 0).stochastic == (
        0,
        1,
        2,
        3,
        4,
    )  # cps has no noise at the last step
    window = load_config(
        overrides=[
            "rollout.num_inference_steps=6",
            "rollout.sde_window_size=2",
            "rollout.sde_window_range=[0,3]",
        ]
    )
    plans = {flow.noisy_steps(window, s).stochastic for s in range(40)}
    assert plans <= {(0, 1), (1, 2)} and len(plans) == 2  # drawn per step, inside the range


@pytest.mark.parametrize(
    ("step", "roll_back", "window"),
    [
        (0, True, (0, 1, 2, 3)),
        (24, True, (0, 1, 2, 3)),
        (25, True, (1, 2, 3, 4)),
        (25 * 19, True, (19, 20, 21, 22)),
        (25 * 21, True, (21, 22)),  # the window ends at step N-3
        (25 * 22, True, (22,)),
        (25 * 23, True, (0, 1, 2, 3)),  # rolled back
        (25 * 30, False, (22,)),  # stays at the last start
    ],
)
def test_mixgrpo_window_follows_its_schedule(step: int, roll_back: bool, window) -> None:
    over = [f"algo.params.roll_back={str(roll_back).lower()}"]
    cfg = load_config(
        algo="mixgrpo", overrides=[*over, "model.path=/real", "rollout.num_inference_steps=25"]
    )
    assert (cfg.rollout.sde_window_size, cfg.algo.params["shift_every"]) == (4, 25)
    plan = get_algorithm("mixgrpo").noisy_steps(cfg, step)
    assert plan.stochastic == plan.trainable == window


def test_mixgrpo_steps_are_flowgrpo_sde_inside_the_window_and_euler_outside() -> None:
    cfg = load_config(
        algo="mixgrpo", overrides=["rollout.num_inference_steps=5", "algo.params.shift_every=1"]
    )
    plan = get_algorithm("mixgrpo").noisy_steps(cfg, 1)
    assert plan.stochastic == (1, 2)
    a = cfg.rollout.noise_level
    spec = SamplerSpec(
        sigmas=SIGMAS,
        window=plan.trainable,
        sde_type="sde",
        noise_level=a,
        stochastic=plan.stochastic,
    )
    ro = sample_rollout(_fake_adapter(), None, [torch.Generator().manual_seed(3)], spec)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, generator=g).double()
    logps = []
    for i in range(5):
        s, s1 = float(SIGMAS[i]), float(SIGMAS[i + 1])
        v = _velocity(x, s)
        if i in (1, 2):
            s_t = a * math.sqrt(s / (1 - s))
            dt = s1 - s
            mean = x * (1 + s_t**2 / (2 * s) * dt) + v * (1 + s_t**2 * (1 - s) / (2 * s)) * dt
            std = s_t * math.sqrt(-dt)
            x = mean + std * torch.randn(3, 4, generator=g).double()
            logps.append(float(torch.distributions.Normal(mean, std).log_prob(x).mean()))
        else:
            x = x + (s1 - s) * v
    torch.testing.assert_close(ro.final[0].double(), x, rtol=1e-5, atol=1e-5)
    assert ro.log_probs[0].tolist() == pytest.approx(logps, rel=1e-5)


def test_every_registered_algorithm_has_every_part() -> None:
    from digen.algos.base import Algorithm
    from digen.registry.models import BACKBONES

    for name in ALGO_NAMES:
        algo = get_algorithm(name)
        assert isinstance(algo, Algorithm) and algo.name == name and algo.title and algo.sde_types
        for method in ("noisy_steps", "preset"):  # what the base cannot supply
            assert getattr(type(algo), method) is not getattr(Algorithm, method), (name, method)
        for backbone in BACKBONES.values():
            for real in (False, True):
                sections = algo.preset(backbone, real)
                assert set(sections) <= {"rollout", "algo", "train", "data", "model", "eval"}
        cfg = load_config(algo=name)
        plan = algo.noisy_steps(cfg, 0)
        assert set(plan.trainable) <= set(plan.stochastic)
        assert algo.train_steps(cfg, 0)  # something trains
        if algo.trains_on == "transitions":  # the trained transitions are sampled and kept
            assert plan.trainable and set(algo.train_steps(cfg, 0)) <= set(plan.trainable)
        else:
            assert algo.trains_on == "final"
        assert cfg.rollout.sde_type in algo.sde_types


def test_flowgrpo_fast_is_the_published_fast_recipe_on_flowgrpos_window() -> None:
    from digen.presets import preset
    from digen.registry.models import get_backbone

    fast = get_algorithm("flowgrpo-fast")
    real = fast.preset(get_backbone("sd3"), True)
    r, a = real["rollout"], real["algo"]
    # geneval_sd3_fast_nocfg: 10 steps, a cps window of 3 in the first half, a = 0.8, no CFG
    assert (r["num_inference_steps"], r["sde_window_size"], r["sde_window_range"]) == (
        10,
        3,
        [0, 5],
    )
    assert (r["sde_type"], r["noise_level"], r["guidance_scale"]) == ("cps", 0.8, 1.0)
    assert (a["clip_ratio"], a["kl_coef"], a["adv_std"]) == (1e-5, 0.0, "global")
    # the same plan as flowgrpo with these settings: digen's window expresses it
    cfg = load_config(base=preset("sd3", "flowgrpo-fast", real_weights=True))
    same = load_config(
        base=preset("sd3", "flowgrpo", real_weights=True),
        overrides=[f"rollout.{k}={v}" for k, v in r.items() if k != "sde_window_range"]
        + ["rollout.sde_window_range=[0,5]"],
    )
    starts = set()
    for step in range(40):
        plan = fast.noisy_steps(cfg, step)
        assert plan == get_algorithm("flowgrpo").noisy_steps(same, step)
        assert len(plan.trainable) == 3 and plan.trainable == plan.stochastic
        assert plan.trainable[0] >= 0 and plan.trainable[-1] < 5
        starts.add(plan.trainable[0])
    assert starts == {0, 1, 2}  # the start is drawn per step over the whole range
    assert cfg.rollout.guidance_scale == 1.0
    with pytest.raises(Exception, match="Flow-GRPO-Fast trains a window"):
        load_config(base=preset("sd3", "flowgrpo-fast"), overrides=["rollout.sde_window_size=0"])


def test_digen_algos_shows_each_published_preset_and_how_each_samples() -> None:
    """The listing a recipe table points to: every algorithm's preset for the model asked,
    read from the algorithm itself, and no SDE type for one that samples with an ODE."""
    from click.testing import CliRunner

    from cli.main import main
    from digen.registry.models import get_backbone

    for model in ("flux", "sd3"):
        res = CliRunner().invoke(main, ["algos", "--model", model])
        assert res.exit_code == 0, res.output
        blocks: dict[str, list[str]] = {}
        for line in res.output.splitlines():  # an algorithm's line, then its indented ones
            if line.startswith("  "):
                blocks[next(reversed(blocks))].append(line.strip())
            else:
                blocks[line.split(":")[0]] = []
        assert list(blocks) == list(ALGO_NAMES)
        for name, lines in blocks.items():
            algo = get_algorithm(name)
            rollout = algo.preset(get_backbone(model), True)["rollout"]
            preset = next(x for x in lines if x.startswith(f"preset for {model} with --model-path"))
            assert f"rollout.num_inference_steps={rollout['num_inference_steps']}" in preset
            if algo.stochastic_sampling:
                assert f"rollout.sde_type: {', '.join(algo.sde_types)}" in lines[0]
            else:
                assert lines[0] == "sampling: deterministic (ODE); rollout.sde_type does not apply"
                assert not any(x.startswith("rollout.sde_type:") for x in lines)
