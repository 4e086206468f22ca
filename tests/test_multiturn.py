"""Multi-turn rollouts with environments: token layout, per-turn rewards, masking out of every loss term, loading."""

import dataclasses
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jppo.advantages.estimate import compute_advantages
from jppo.config import ConfigError, load_config
from jppo.core.masked import global_norm_stats
from jppo.core.settings import PolicyLossOptions
from jppo.data.tasks import get_task
from jppo.data.tokenizer import CharTokenizer
from jppo.losses import actor_loss
from jppo.losses.entropy import entropy_from_logits
from jppo.rewards.placement import place_rewards, token_credit_rewards
from jppo.rollout.env import Calculator, evaluate, load_env, stop_token_ids
from jppo.rollout.multiturn import Trajectory, longest_context, run_turns, to_experience
from jppo.run.collect import decode_responses
from jppo.run.filters import overlong_filtered, truncated_rows

TOKENIZER = CharTokenizer("0123456789+-*=[];?ab")


def ids(text: str, eos: bool = False) -> list[int]:
    return TOKENIZER.encode(text) + ([TOKENIZER.eos_id] if eos else [])


class FixedEnv:
    """Answers every call with the next of ``observations`` and rewards turn ``t`` with ``rewards[t]``."""

    stop = ("]",)

    def __init__(self, observations=("=1;", "=22;"), rewards=(0.5, -0.25, 2.0)):
        self.observations, self.rewards, self.turn, self.actions = list(observations), rewards, 0, []

    def reset(self, prompt, example):
        return ""

    def step(self, action):
        self.actions.append(action)
        reward = self.rewards[self.turn]
        self.turn += 1
        if not action.endswith("]"):
            return "", reward, True
        return self.observations.pop(0), reward, False


def scripted(turns: list[list[list[int]]]):
    """A turn sampler that returns ``turns[t][row]`` (log-prob -(position+1)/10 for each token) and records contexts."""
    seen = []

    def sample_turn(contexts, turn):
        seen.append([list(c) for c in contexts])
        tokens = turns[turn]
        return tokens, [[-(i + 1) / 10 for i in range(len(t))] for t in tokens]

    return sample_turn, seen


def rollout(turns, envs, prompts, *, max_turns=4, max_length=16):
    trajectories = [Trajectory(prompt=p) for p in prompts]
    sample_turn, seen = scripted(turns)
    run_turns(sample_turn, trajectories, envs, tokenizer=TOKENIZER, stop_ids=tuple(ids("]")), max_turns=max_turns,
              max_length=max_length)
    exp = to_experience(trajectories, np.arange(len(prompts)), pad_id=TOKENIZER.pad_id, max_length=max_length, bucket=4)
    return exp, seen


def test_a_turn_starts_from_at_most_the_longest_context_and_can_reach_it():
    """``jppo.plan`` sizes a multi-turn sampler's prompt cache by :func:`longest_context`: a row whose tool answer
    leaves one response slot free takes another turn from prompt + 15 of its 16 slots; one whose answer would
    fill the last slot ends instead."""
    envs = [FixedEnv(observations=("=" + "1" * 10 + ";",)), FixedEnv(observations=("=" + "1" * 11 + ";",))]
    turns = [[ids("[1]"), ids("[1]")], [ids("2", eos=True), ids("0")]]
    _, seen = rollout(turns, envs, [ids("5="), ids("6=")], max_length=16)
    assert [len(context) for context in seen[1]] == [2 + 3 + 12, 1]  # row 1 ended (a one-token dummy context)
    assert longest_context(2, 16) == 2 + 15 == max(len(c) for turn in seen for c in turn)


def test_fixed_observations_give_the_expected_layout_and_per_turn_rewards():
    envs = [FixedEnv(), FixedEnv()]
    turns = [
        [ids("[1]"), ids("7", eos=True)],  # row 0 calls the tool; row 1 answers at once
        [ids("[2]"), ids("0")],  # row 1 is done: its dummy sample is ignored
        [ids("22", eos=True), ids("0")],
    ]
    exp, seen = rollout(turns, envs, [ids("5="), ids("6=")])
    # row 0: [1] =1; [2] =22; 22<eos>  (model, env, model, env, model)
    expected = ids("[1]=1;[2]=22;22", eos=True)
    assert exp.response_ids[0, : len(expected)].tolist() == expected
    model = [1] * 3 + [0] * 3 + [1] * 3 + [0] * 4 + [1] * 3
    assert exp.response_mask[0, : len(model)].astype(int).tolist() == model
    assert not exp.response_mask[0, len(model):].any() and exp.response_attention[0].sum() == len(model)
    assert exp.response_ids[1, :2].tolist() == ids("7", eos=True) and exp.response_attention[1].sum() == 2
    # the env saw each turn's text; each turn's reward is on that turn's last token
    assert envs[0].actions == ["[1]", "[2]", "22"] and envs[1].actions == ["7"]
    rewards = np.zeros(16, np.float32)
    rewards[[2, 8, 15]] = [0.5, -0.25, 2.0]
    np.testing.assert_array_equal(exp.token_rewards[0], rewards)
    assert exp.token_rewards[1, 1] == 0.5 and exp.token_rewards[1].sum() == 0.5
    # sampler log-probs on model tokens only; later turns saw prompt + response so far, finished rows a dummy
    assert exp.rollout_log_prob[0, 3:6].tolist() == [0, 0, 0] and exp.rollout_log_prob[0, 6] == pytest.approx(-0.1)
    assert seen[1] == [ids("5=[1]=1;"), [TOKENIZER.pad_id]]
    assert seen[2][0] == ids("5=[1]=1;[2]=22;")
    texts, finished = decode_responses(exp, TOKENIZER)
    assert texts == ["[1]=1;[2]=22;22", "7"] and finished == [True, True]


def test_training_rewards_keep_per_turn_rewards_on_their_turns_and_the_outcome_on_the_last_model_token():
    envs = [FixedEnv(), FixedEnv()]
    turns = [[ids("[1]"), ids("7", eos=True)], [ids("[2]"), ids("0")], [ids("22", eos=True), ids("0")]]
    exp, _ = rollout(turns, envs, [ids("5="), ids("6=")])
    task_scores = np.array([1.0, 0.25], np.float32)
    scores = task_scores + exp.token_rewards.sum(axis=1)  # what Collector.score reports per row
    rewards = place_rewards(exp, scores, [True, True], None, TOKENIZER.decode)
    expected = np.zeros_like(rewards)
    expected[0, [2, 8, 15]] = [0.5, -0.25, 2.0 + 1.0]  # the last turn's env reward plus the outcome
    expected[1, 1] = 0.5 + 0.25
    np.testing.assert_allclose(rewards, expected, rtol=1e-6)


def test_turn_and_length_limits_end_a_row_without_a_dangling_observation():
    # max_turns=1: the call is stepped (its reward counts) but its observation is not appended
    exp, _ = rollout([[ids("[1]")]], [FixedEnv()], [ids("5=")], max_turns=1)
    assert exp.response_attention[0].sum() == 3 and exp.token_rewards[0, 2] == 0.5
    # an observation that would leave no slot for a model token is dropped; a turn cut by the limit is not stepped
    env = FixedEnv(observations=("=123;",))
    exp, _ = rollout([[ids("[1]")]], [env], [ids("5=")], max_length=8)
    assert exp.response_attention[0].sum() == 3
    env = FixedEnv()
    exp, _ = rollout([[ids("[1]")], [ids("123456789")]], [env], [ids("5=")], max_length=8)
    assert exp.response_attention[0].sum() == 8 and exp.response_mask[0].sum() == 5 and env.actions == ["[1]"]
    _, finished = decode_responses(exp, TOKENIZER)
    assert finished == [False]



class Submit(Calculator):
    """Ends the episode at the first bracketed action (a one-shot submission): ``done`` without EOS."""

    def step(self, action):
        return "", 1.0, True


def test_overlong_filter_masks_only_episodes_the_length_limit_cut():
    """An episode ended by the environment (done) or by rollout.max_turns keeps its loss tokens without EOS; one
    cut by rollout.max_response_length (a turn cut, or an observation with no room left) loses them."""
    cases = [  # (env, turns, max_turns, max_length) -> truncated
        (Submit(), [[ids("[7*58]")]], 4, 16, False),  # the environment said done
        (Calculator(), [[ids("[7*58]")]], 1, 16, False),  # the turn limit ended it
        (Calculator(), [[ids("[7*58]")], [ids("406", eos=True)]], 4, 16, False),  # answered at EOS
        (Calculator(), [[ids("[7*58]")]], 4, 10, True),  # "=406;" would leave no slot for the answer
        (Calculator(), [[ids("7*58*9*9*9*9")]], 4, 8, True),  # the turn was cut at 8 tokens
    ]
    for env, turns, max_turns, max_length, truncated in cases:
        exp, _ = rollout(turns, [env], [ids("7*58=")], max_turns=max_turns, max_length=max_length)
        _, ended_eos = decode_responses(exp, TOKENIZER)
        assert truncated_rows(exp, ended_eos).tolist() == [truncated], (env, turns, max_turns, max_length)
        tokens = int(exp.response_mask.sum())
        assert tokens >= 6
        assert int(overlong_filtered(exp, ended_eos).response_mask.sum()) == (0 if truncated else tokens)
    # a single-turn batch (no flags) is cut exactly where it has no EOS: it stops only there or at the limit
    exp, _ = rollout([[ids("406", eos=True), ids("12345678")]], [Submit(), Submit()], [ids("7*58="), ids("7*58=")],
                     max_turns=1, max_length=8)
    single = dataclasses.replace(exp, truncated=None)
    _, ended_eos = decode_responses(single, TOKENIZER)
    assert ended_eos == [True, False] and truncated_rows(single, ended_eos).tolist() == [False, True]

def _multi_turn_batch():
    envs = [FixedEnv(), FixedEnv(), FixedEnv(), FixedEnv()]
    turns = [
        [ids("[1]"), ids("3", eos=True), ids("[12]"), ids("45", eos=True)],
        [ids("1", eos=True), ids("0"), ids("5", eos=True), ids("0")],
    ]
    exp, _ = rollout(turns, envs, [ids("5="), ids("6="), ids("5="), ids("6=")], max_length=10)
    return dataclasses.replace(exp, group_ids=np.array([0, 0, 1, 1]))


@pytest.mark.parametrize("estimator", ["gae", "grpo", "reinforce_plus_plus"])
def test_environment_tokens_get_no_advantage_and_no_return(estimator):
    exp = _multi_turn_batch()
    observation = exp.response_attention & ~exp.response_mask
    assert observation.sum() == 6
    values = np.random.default_rng(0).normal(size=exp.response_mask.shape).astype(np.float32)
    advantages, returns = compute_advantages(
        estimator, token_level_rewards=exp.token_rewards, response_mask=exp.response_mask, values=values,
        group_ids=exp.group_ids, gamma=0.9, lam=0.8,
    )
    assert not advantages[observation].any() and not returns[observation].any()
    assert np.abs(advantages[exp.response_mask]).sum() > 0


def test_gae_skips_an_observation_span_as_if_it_were_absent():
    """GAE over a response with an observation span equals GAE over the same response with the span cut out."""
    exp = _multi_turn_batch()
    rng = np.random.default_rng(1)
    values = rng.normal(size=exp.response_mask.shape).astype(np.float32)
    rewards = rng.normal(size=exp.response_mask.shape).astype(np.float32)
    advantages, returns = compute_advantages(
        "gae", token_level_rewards=rewards, response_mask=exp.response_mask, values=values, gamma=0.9, lam=0.8
    )
    keep = exp.response_mask[0]
    width = int(keep.sum())
    squeezed = lambda x: x[:1, keep]  # noqa: E731
    _, alone = compute_advantages(
        "gae", token_level_rewards=squeezed(rewards), response_mask=np.ones((1, width), bool), values=squeezed(values),
        gamma=0.9, lam=0.8,
    )
    np.testing.assert_allclose(returns[0, keep], alone[0], rtol=1e-5)


def test_environment_tokens_receive_no_gradient_from_any_loss_term():
    """d(actor loss)/d(logits) is 0 at observation tokens (policy, entropy and KL terms) and N counts model tokens."""
    exp = _multi_turn_batch()
    mask = jnp.asarray(exp.response_mask)
    rng = np.random.default_rng(2)
    shape = exp.response_mask.shape + (TOKENIZER.vocab_size,)
    logits = jnp.asarray(rng.normal(size=shape), jnp.float32)
    old = jnp.asarray(rng.normal(size=exp.response_mask.shape) - 3, jnp.float32)
    ref = jnp.asarray(rng.normal(size=exp.response_mask.shape) - 3, jnp.float32)
    advantages = jnp.asarray(rng.normal(size=exp.response_mask.shape), jnp.float32)  # garbage off the mask too
    norm = global_norm_stats(mask, loss_scale_factor=10.0)
    assert float(norm.num_tokens) == exp.response_mask.sum()

    def loss(logits, mode):
        tokens = jnp.asarray(exp.response_ids)[..., None]
        log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens, -1)[..., 0]
        value, _ = actor_loss(
            log_probs, old, advantages, mask, norm=norm, mode=mode, policy_loss_name="vanilla",
            policy_options=PolicyLossOptions(), entropy=entropy_from_logits(logits, mask), entropy_coeff=0.1,
            ref_log_prob=ref, kl_loss_coef=0.2,
        )
        return value

    observation = exp.response_attention & ~exp.response_mask
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        grad = np.asarray(jax.grad(loss)(logits, mode))
        assert not grad[observation].any(), mode
        assert np.abs(grad[exp.response_mask]).sum(axis=-1).min() > 0, mode


def test_token_credit_skips_observation_characters():
    task = get_task("tool_multiply")
    example = task.examples("train", 1, 0)[0]
    call = f"[{example.prompt[:-1]}]"
    observation = f"={example.answer};"
    text = call + observation + example.answer
    tokens = ids(text, eos=True)
    width = len(tokens)
    response = np.zeros((1, width + 2), np.int32)
    response[0, :width] = tokens
    attention = np.zeros((1, width + 2), bool)
    attention[0, :width] = True
    mask = attention.copy()
    mask[0, len(call) : len(call) + len(observation)] = False
    assert task.score(text, example) == pytest.approx(1.0)
    out = token_credit_rewards(response, mask, [task.credit(text, example, True)], [True], np.array([1.0], np.float32),
                               TOKENIZER.decode, attention)
    np.testing.assert_allclose(out[0, : len(call)], task.call_weight / len(call), rtol=1e-6)
    assert not out[0, len(call) : len(call) + len(observation)].any()
    answer = slice(len(call) + len(observation), width - 1)
    np.testing.assert_allclose(out[0, answer], (1 - task.call_weight) / len(example.answer), rtol=1e-6)
    assert out.sum() == pytest.approx(1.0)


def test_calculator_evaluates_calls_and_ends_on_an_answer():
    calc = Calculator()
    assert calc.step("[12*34]") == ("=408;", 0.0, False)
    assert calc.step("7[2+3*4]") == ("=14;", 0.0, False)
    assert calc.step("[2**99]") == ("=?;", 0.0, False)
    assert calc.step("408") == ("", 0.0, True)
    assert evaluate("__import__('os')") is None and evaluate("-3*-2") == 6 and evaluate("9" * 16) is None
    assert stop_token_ids(Calculator, TOKENIZER) == tuple(ids("]"))


def test_calculator_closes_a_call_the_prompt_opened_and_the_hinted_task_pays_only_the_answer_read_back():
    """``call_hint``: the prompt opens the call, the policy's ``]`` closes it, the calculator answers with the
    product, and with ``call_weight: 0`` only the answer's digits (copied from that result) earn credit."""
    task = get_task("tool_multiply", {"call_hint": True, "call_weight": 0.0})
    example = task.examples("val", 1, 0)[0]
    a, b = example.prompt[: example.prompt.index("=")].split("*")
    assert example.prompt == f"{a}*{b}=[{a}*{b}" and example.answer == str(int(a) * int(b))
    rows = [Trajectory(prompt=ids(example.prompt)) for _ in range(3)]
    envs = [Calculator() for _ in rows]
    assert all(env.reset(example.prompt, example) == "" for env in envs)
    wrong = str(int(example.answer) + 1)
    turns = [[ids("]"), ids(example.answer, eos=True), ids("]")],
             [ids(example.answer, eos=True), [], ids(wrong, eos=True)]]
    run_turns(scripted(turns)[0], rows, envs, tokenizer=TOKENIZER, stop_ids=tuple(ids("]")), max_turns=2,
              max_length=16)
    texts = [TOKENIZER.decode(row.ids) for row in rows]
    observation = f"={example.answer};"
    assert texts == ["]" + observation + example.answer, example.answer, "]" + observation + wrong]
    assert rows[0].from_model == [True] + [False] * len(observation) + [True] * (len(example.answer) + 1)
    # read back: 1; answered without the tool but right: 1 (the call itself earns nothing); misread: not 1
    assert [task.score(text, example) for text in texts[:2]] == [1.0, 1.0] and task.score(texts[2], example) < 1
    credit = task.credit(texts[0], example)
    assert credit[: 1 + len(observation)] == [0.0] * (1 + len(observation)) and credit[-1] == 0.0
    assert credit[1 + len(observation) : -1] == pytest.approx([1 / len(example.answer)] * len(example.answer))


def test_the_tools_quickstart_pays_in_full_only_for_a_call_whose_result_is_read_back():
    """configs/quickstart_tools.yaml, its real prompts, calculator and reward: on every held-out prompt the policy's
    ``]`` gets the product from the calculator, and copying it is the only way to the full reward."""
    import pathlib  # noqa: PLC0415

    from jppo.run.build import load_inputs  # noqa: PLC0415

    config = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart_tools.yaml"
    cfg = load_config(config, [])
    inputs = load_inputs(cfg)
    examples = inputs.val_data.examples
    tokenizer = inputs.tokenizer
    rows = [Trajectory(prompt=list(p)) for p in inputs.val_data.prompt_ids]
    envs = [inputs.env_factory() for _ in rows]
    assert all(env.reset(e.prompt, e) == "" for env, e in zip(envs, examples))
    turns = [[tokenizer.encode("]")] * len(rows), [tokenizer.encode(e.answer) + [tokenizer.eos_id] for e in examples]]
    run_turns(scripted(turns)[0], rows, envs, tokenizer=tokenizer, stop_ids=inputs.stop_ids,
              max_turns=cfg.rollout.max_turns, max_length=cfg.rollout.max_response_length)
    texts = [tokenizer.decode(row.ids) for row in rows]
    assert texts == [f"]={e.answer};{e.answer}" for e in examples]
    every = [True] * len(rows)
    np.testing.assert_array_equal(inputs.reward_fn(texts, examples, every), 1.0)
    call_only = inputs.reward_fn([text[: text.index(";") + 1] for text in texts], examples, every)
    answer_only = inputs.reward_fn([e.answer for e in examples], examples, every)
    weight = cfg.data.task_options["call_weight"]
    np.testing.assert_allclose(call_only, weight, rtol=1e-6)  # float32 of the call's share
    np.testing.assert_allclose(answer_only, 1 - weight, rtol=1e-6)


def test_environment_is_loaded_by_path(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent("""
        class Echo:
            stop = ("]",)
            def reset(self, prompt, example):
                return "a"
            def step(self, action):
                return "b", 1.0, True
        def make():
            return Echo()
        def broken():
            return object()
    """))
    factory = load_env(f"{path}:make")
    assert factory().step("x") == ("b", 1.0, True)
    with pytest.raises(ValueError, match=r"rollout.env=.*'nope' does not exist"):
        load_env(f"{path}:nope")
    with pytest.raises(ValueError, match=r"rollout.env=.*needs reset\(prompt, example\), step\(action\) and stop"):
        load_env(f"{path}:broken")
    with pytest.raises(ValueError, match=r"stop text 'ab' is 2 tokens"):
        stop_token_ids(lambda: type("E", (), {"stop": ("ab",)})(), TOKENIZER, "x")


@pytest.mark.parametrize("override,message", [
    ("rollout.max_turns=0", "rollout.max_turns=0 must be > 0"),
    ("rollout.env=builtin:calc", "rollout.env='builtin:calc' is not valid (did you mean 'builtin:calculator'?)"),
])
def test_bad_multi_turn_settings_are_one_line_config_errors(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, ["data.task=tool_multiply", override])
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("override,message", [
    ("rollout.env={tmp}/missing.py:make", r"^rollout.env=.*missing.py.* does not exist$"),
    ("data.task_options.left_digits=0", r"^data.task_options left_digits=0 is invalid for task 'tool_multiply'"),
    ("data.task_options.call_hint=3", r"^data.task_options call_hint=3 is invalid for task 'tool_multiply'"),
    ("data.task=reverse_digits", r"^rollout.env='builtin:calculator': its stop text '\]' cannot be encoded"),
])
def test_an_environment_or_task_that_does_not_load_is_a_one_line_config_error(tmp_path, override, message):
    from jppo.run.build import load_inputs  # noqa: PLC0415

    overrides = ["data.task=tool_multiply", "rollout.env=builtin:calculator", override.format(tmp=tmp_path)]
    with pytest.raises(ConfigError, match=message) as error:
        load_inputs(load_config(None, overrides))
    assert "\n" not in str(error.value)


class DigitStops:
    """Ends a model turn at every digit and answers ``ab`` (so a random model takes many turns)."""

    stop = tuple("0123456789")

    def reset(self, prompt, example):
        return ";"

    def step(self, action):
        return "ab", 0.0, False


def tiny_multi_turn_sampler(env_factory, stops: str, max_prompt_length: int):
    """A 1-layer random policy sampling ``n = 2`` multi-turn responses of up to 12 tokens on one device."""
    from flax import nnx  # noqa: PLC0415

    from jppo.models import CausalLM, ModelConfig, create_model  # noqa: PLC0415
    from jppo.parallel.mesh import make_mesh  # noqa: PLC0415
    from jppo.rollout import Sampler, SamplingParams  # noqa: PLC0415
    from jppo.rollout.multiturn import MultiTurnSampler  # noqa: PLC0415

    config = ModelConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1,
                         num_heads=2, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    mesh = make_mesh(devices=jax.devices()[:1])
    graphdef, params = nnx.split(create_model(CausalLM, config, mesh, seed=0), nnx.Param)
    stop_ids = tuple(ids(stops))
    turn = SamplingParams(max_new_tokens=12, n=1, eos_token_ids=(TOKENIZER.eos_id,) + stop_ids, pad_token_id=0)
    sampler = MultiTurnSampler(Sampler(graphdef, 0, mesh, turn, 8), env_factory, TOKENIZER, n=2, stop_ids=stop_ids,
                               max_turns=4, max_length=12, bucket=8, max_prompt_length=max_prompt_length,
                               env=env_factory.__name__)
    return sampler, graphdef, params, mesh


def test_sampler_log_probs_of_a_multi_turn_response_are_the_trainers():
    """Each turn re-prefills prompt + response so far: the sampler's log-probs of the model tokens equal the
    training forward pass's over the whole response (observations attended), to float32 rounding."""
    from jppo.data.tasks import Example  # noqa: PLC0415
    from jppo.engine import forward_batch, log_prob_fn  # noqa: PLC0415

    # "345=" + the reset observation ";" is 5 tokens: a prompt may fill data.max_prompt_length with it
    sampler, graphdef, params, mesh = tiny_multi_turn_sampler(DigitStops, "0123456789", max_prompt_length=5)
    prompts = ["12=", "345="]
    exp = sampler(params, [ids(p) for p in prompts], jax.random.key(0), [Example(p, "") for p in prompts])
    assert exp.group_ids.tolist() == [0, 0, 1, 1] and exp.prompt_ids[0, -4:].tolist() == ids("12=;")
    observation = exp.response_attention & ~exp.response_mask
    assert observation.any(), "the random model took no second turn"
    forward = forward_batch(log_prob_fn(graphdef, temperature=1.0, chunk_size=256), params, exp, mesh,
                            micro_batch_size=4)
    np.testing.assert_allclose(forward[exp.response_mask], exp.rollout_log_prob[exp.response_mask], atol=2e-5)
    assert not exp.rollout_log_prob[observation].any()



class HintedCalculator(Calculator):
    """The calculator, whose reset shows a worked call after the prompt."""

    def reset(self, prompt, example):
        return "[9*9]=81;"


def test_a_reset_observation_that_overflows_data_max_prompt_length_is_a_one_line_config_error():
    """Prompt + reset observation is what the sequence bounds (ppo_max_token_len, the memory plan) assume is at most
    data.max_prompt_length; a longer one is refused at the reset, before any turn is sampled."""
    from jppo.data.tasks import Example  # noqa: PLC0415

    sampler, _, params, _ = tiny_multi_turn_sampler(HintedCalculator, "]", max_prompt_length=13)
    with pytest.raises(ConfigError) as error:
        sampler(params, [ids("7*58=")], jax.random.key(0), [Example("7*58=", "406")])
    assert str(error.value) == (
        "rollout.env='HintedCalculator': reset on the prompt '7*58=' returned a 9-token observation, so the prompt is "
        "5 + 9 = 14 tokens > data.max_prompt_length=13; the limit bounds the prompt with its reset observation: raise "
        "it or shorten the observation"
    )



def test_the_trainer_exits_2_with_that_line_instead_of_failing_mid_run(tmp_path, capsys):
    """With token-budget micro-batching at exactly data.max_prompt_length + rollout.max_response_length tokens, a
    reset observation used to lengthen the sequences past ppo_max_token_len and fail the first forward pass."""
    from jppo.train import main  # noqa: PLC0415

    env = tmp_path / "hinted.py"
    env.write_text(textwrap.dedent("""
        from jppo.rollout.env import Calculator
        class Hinted(Calculator):
            def reset(self, prompt, example):
                return "[9*9]=81;"
    """))
    overrides = [
        # the task without its call hint, at the bound the test was written for: 8 + 16 = 24 tokens is the budget
        "data.max_prompt_length=8", "data.task_options.call_hint=false",
        f"rollout.env={env}:Hinted", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len=24",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "trainer.total_steps=1",
        "model.hidden_size=16", "model.intermediate_size=32", "model.num_layers=1", "model.num_heads=2",
        "trainer.val_every=0", "trainer.plots=false", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    assert main(["--config", "configs/quickstart_tools.yaml", *overrides]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"jppo.train: error: rollout.env='{env}:Hinted': reset on the prompt ")
    assert "returned a 9-token observation" in line and "> data.max_prompt_length=8" in line


def test_tool_multiply_scores_the_call_and_the_answer_after_the_calculators_result():
    from jppo.data.tasks import Example  # noqa: PLC0415

    task, example = get_task("tool_multiply"), Example("7*58=", "406")
    weight = task.call_weight
    assert task.score("[7*58]=406;406", example) == pytest.approx(1.0)
    assert task.score("406", example) == pytest.approx(1 - weight)  # right without the tool: the answer's share
    assert task.score("[7*59]=413;413", example) == pytest.approx(weight * 5 / 6 + (1 - weight) / 3)
    assert task.score(";;406", example) == 0.0  # a typed ';' is no calculator result: the answer starts at 0
    assert [len(e.prompt) for e in task.examples("train", 50, 0)] == [6] * 50  # default: 2 x 2 digits
    assert all(len(e.answer) == 4 for e in task.examples("val", 20, 0))
