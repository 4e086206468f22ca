"""``results.md``: the results of :mod:`bench.run` as Markdown tables, with the machine and versions on top (and
``results.json`` beside it).

A benchmark run by itself prints its own section (:func:`section`, through :func:`command`), so a table looks
the same whether it comes from one benchmark or from the whole suite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
from typing import Callable

MIB = 2**20


def _num(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def _header(results: dict) -> list[str]:
    env = results["environment"]
    v = env["versions"]
    written = datetime.datetime.now().astimezone()
    return [
        f"# jppo benchmarks ({results['mode']} mode)",
        "",
        f"- machine: {env['cpu']}, {env['cpu_cores']} cores; JAX backend `{env['backend']}` "
        f"({env['device_count']} x {env['device_kind']})",
        f"- load average (1 min): {env['load_average_1m']:.2f} at start, "
        f"{_num(env.get('load_average_1m_end'), 2)} at end",
        f"- versions: python {env['python']}, jax {v['jax']} (jaxlib {v['jaxlib']}), flax {v['flax']}, "
        f"optax {v['optax']}, torch {v['torch']}, transformers {v['transformers']}, numpy {v['numpy']}",
        f"- torch threads: {env['torch_threads']} (= the cores XLA's CPU pool uses), "
        f"OMP_WAIT_POLICY={env['omp_wait_policy']}",
        f"- written {written:%Y-%m-%d %H:%M %Z}; the whole run took {results['wall_s']:.0f} s",
        "",
    ]


def _row(cells) -> str:
    return f"| {' | '.join(map(str, cells))} |"


def _grid(columns: list[str], rows, align: str | None = None) -> list[str]:
    """A Markdown table of ``rows`` (lists of cells), aligned by ``align``, one letter a column (``l``, ``r``;
    default: the first column left, the rest right)."""
    align = align or "l" + "r" * (len(columns) - 1)
    return [_row(columns), f"|{'|'.join('---' if side == 'l' else '---:' for side in align)}|", *map(_row, rows)]


def _table(title: str, intro: str, columns: list[str], rows, align: str | None = None) -> list[str]:
    """A section: its heading, its introductory sentence (if any) and its table (:func:`_grid`)."""
    return [f"## {title}", "", *([intro, ""] if intro else []), *_grid(columns, rows, align), ""]


def _spread(timing: dict, digits: int, scale: float = 1.0) -> list[str]:
    """A timing's median, fastest and slowest repeat (seconds times ``scale``)."""
    return [f"{scale * timing[key]:.{digits}f}" for key in ("median_s", "min_s", "max_s")]


def _headline_table(results: dict) -> list[str]:
    rows = [[f"`{key}`", _num(results[key]), meaning] for key, meaning in results["ratio_meanings"].items()
            if key in results]
    return _table("Headline ratios", "", ["key", "value", "meaning"], rows, align="lrl")


def _accumulation(result: dict) -> list[str]:
    batch, model, base = result["batch"], result["model"], result["steps"]["K=1"]["median_s"]
    return _table(
        "Accumulation and normalization",
        f"Actor update (one optimizer step) of {batch['rows']} sequences x {batch['prompt']}+{batch['response']} "
        f"tokens ({result['response_tokens']} response tokens), {model['num_layers']} layers d{model['hidden_size']}, "
        f"vocab {model['vocab_size']}; the same mini-batch cut into K micro-batches.",
        ["step", "compile s", "median ms", "min ms", "max ms", "us / response token", "vs K=1"],
        [[name, f"{step['compile_s']:.2f}", *_spread(step, 1, 1e3), f"{step['us_per_token']:.2f}",
          f"{step['median_s'] / base:.3f}"] for name, step in result["steps"].items()],
    )


def _tokens_per_s(tokens: int, step: dict) -> str:
    """Median tokens/s, with the fastest and the slowest repeat."""
    return f"{tokens / step['median_s']:,.0f} ({tokens / step['min_s']:,.0f} - {tokens / step['max_s']:,.0f})"


def _update_vs_torch(results: dict) -> list[str]:
    first, rows = next(iter(results.values())), []
    for size, result in results.items():
        m, tokens, losses = result["model"], result["batch"]["tokens"], result["first_pg_loss"]
        shape = (f"{m['num_layers']}L d{m['hidden_size']} ff{m['intermediate_size']} "
                 f"h{m['num_heads']}/kv{m['num_kv_heads']} V{m['vocab_size']}, T{result['batch']['length']}")
        rows.append([size, shape, f"{tokens:,}", _tokens_per_s(tokens, result["steps"]["jppo"]),
                     _tokens_per_s(tokens, result["steps"]["torch"]), f"{result['ratio']:.2f}",
                     f"{losses['jppo']:.6f} / {losses['torch']:.6f}"])
    return _table(
        "Update step vs PyTorch eager",
        "Forward + backward + clipping + AdamW of a PPO actor step, same Qwen2-shaped model, weights, batch and loss, "
        f"float32; jppo on {first['jax_device']}, torch on {first['torch_device']} with {first['torch_threads']} "
        "threads. Tokens/s: median (fastest - slowest repeat).",
        ["size", "model", "tokens / step", "jppo tokens/s", "torch tokens/s", "jppo / torch",
         "first pg_loss jppo / torch"],
        rows, align="llrrrrr",
    )


def _sampler(result: dict) -> list[str]:
    prompts, model, kv = result["prompts"], result["model"], result["methods"]["kv_sampler"]["median_s"]
    return _table(
        "Rollout (greedy decoding)",
        f"{prompts['batch']} prompts of {prompts['min_length']}-{prompts['max_length']} tokens (padded to "
        f"{prompts['padded_to']}), {result['new_tokens']} new tokens, Qwen2-shaped {model['num_layers']} layers "
        f"d{model['hidden_size']} V{model['vocab_size']}; transformers {result['versions']['transformers']} on CPU "
        f"torch with {result['torch_threads']} threads.",
        ["method", "median s", "min s", "max s", "tokens/s", "KV sampler speed-up", "same tokens as KV sampler"],
        [[name, *_spread(method, 4), f"{method['tokens_per_s']:,.0f}", f"{method['median_s'] / kv:.2f}x",
          f"{method['same_tokens_as_kv_sampler']:.1%}"] for name, method in result["methods"].items()],
    )


def _rollout_shapes(result: dict) -> list[str]:
    model = result["model"]
    return _table(
        "Rollout at a GSM8K-like shape (sampling)",
        f"{result['prompts']} prompts of {result['prompt_length']} tokens x n = {result['n']} ({result['rows']} rows), "
        f"{result['new_tokens']} new tokens (EOS {result['eos']}), {result['sampling']}; random Qwen2 "
        f"{model['layers']} layers d{model['hidden']} ff{model['intermediate']} h{model['heads']} V{model['vocab']}; "
        f"transformers {result['versions']['transformers']} `generate` (KV cache) on CPU torch with "
        f"{result['torch_threads']} threads.",
        ["method", "median s", "min s", "max s", "first call s", "tokens/s"],
        [[name, *_spread(method, 3), f"{method['first_s']:.2f}", f"{method['tokens_per_s']:,.0f}"]
         for name, method in result["methods"].items()],
    ) + [f"jppo / transformers tokens/s: {_num(result['rollout_vs_transformers'], 2)}.", ""]


def _end_to_end(result: dict) -> list[str]:
    per_step, target = result["seconds_per_step"], result["time_to_target"]
    untimed = ("logging", "other")  # not parts of timing/step: no share of it
    rows = [[phase, _num(seconds, 4), "" if phase in untimed or not per_step else f"{seconds / per_step:.1%}"]
            for phase, seconds in result["phases_s"].items()]
    rows.append(["**step (timed phases)**", f"**{_num(per_step, 4)}**", ""])
    if target["reached"]:
        outcome = (
            f"first at step {target['step']}, {target['wall_s']:.1f} s wall clock from the start of the run "
            f"({target['train_step_s']:.1f} s of it in training steps)"
        )
    else:
        outcome = f"not reached in {target['steps_run']} steps (best {target['best_reward']:.3f})"
    return _table(
        "End to end (configs/quickstart.yaml)",
        f"{result['steps']} steps ({result['mode']} mode) in {result['run_wall_s']:.1f} s; first step (compiles) "
        f"{result['first_step_s']:.2f} s; later steps, medians:",
        ["phase", "s / step", "share of timed step"], rows,
    ) + [f"Time to target: reward/mean >= {target['target_reward']} {outcome}.", ""]


PEER_SIDES = ("jppo", "trl", "tunix")  # the sides of bench.peers, jppo first


def _peers(result: dict) -> list[str]:
    title = "End to end vs TRL GRPOTrainer and Tunix GRPOLearner"
    missing = [f"Not measured: {reason}." for reason in (result["trl_missing"], result.get("tunix_missing")) if reason]
    if not result["shapes"]:
        return [f"## {title}", "", *missing, ""]
    rows = []
    for name, shape in result["shapes"].items():
        s = shape["shape"]
        lengths = ", ".join(_num(shape.get(f"{side}_mean_response_length"), 1) for side in PEER_SIDES)
        firsts = "; ".join(", ".join(f"{x:.1f}" for x in shape.get(f"{side}_first_step_s", [])) for side in PEER_SIDES)
        diffs = "; ".join(f"{d:.1e}" for d in (shape["logits_max_abs_diff"], shape.get("tunix_logits_max_abs_diff"))
                          if d is not None)
        rows.append([name, f"{s['layers']}L d{s['hidden']} V{s['vocab_size']}", f"{s['prompts']} x {s['n']}",
                     f"{s['prompt_tokens']} / {s['max_response_length']} ({lengths})",
                     s["optimizer_steps_per_training_step"], diffs,
                     *(_num(shape.get(key), 3) for key in ("jppo_s_per_step", "trl_s_per_step", "trl_alone_s_per_step",
                                                           "tunix_s_per_step")),
                     _num(shape.get("trl_over_jppo"), 2), _num(shape.get("tunix_over_jppo"), 2), firsts])
    versions = result["versions"]
    return _table(
        title,
        f"Seconds per GRPO training step, jppo vs TRL {versions.get('trl', '(not run)')} and Tunix "
        f"{versions.get('tunix', '(not run)')} on the same exported weights, prompts, reward, batch and lengths, "
        f"float32 on CPU (torch with {result['torch_threads']} threads, OMP_WAIT_POLICY {result.get('omp', 'user')}); "
        "medians of the steps after the warm-up, runs alternated; TRL alone: bench.trl_alone, TRL's own trainer class "
        "in a process of its own (`--alone`). " + " ".join(missing),
        ["shape", "model", "prompts x n", "prompt / max response (mean jppo, TRL, Tunix)", "optimizer steps",
         "logits max diff (transformers; Tunix)", "jppo s/step", "TRL s/step", "TRL alone s/step", "Tunix s/step",
         "TRL / jppo", "Tunix / jppo", "first step jppo; TRL; Tunix s"],
        rows,
    ) + ["Phases, medians (s); rest: reward, advantages, logging, ...; each run in its own process:", ""] + (
        peer_phases(result) + [""])


# the peers table's phase columns: jppo's timing/* name and the peers' phase (bench.trl_side.run_trl and
# bench.tunix_side.run_tunix name them alike)
PEER_PHASES = {"sampling": ("rollout", "generate"), "old log-probs": ("old_log_prob", "old_log_prob"),
               "update": ("update_actor", "update")}


def peer_phases(result: dict) -> list[str]:
    """Seconds per step and per phase of each side run at each shape (medians over all rounds' steps; 0 for a
    phase a side did not run), the rest of the step, each round's median step (TRL's own run beside TRL's, where
    measured), and on each peer's row its s / jppo s."""
    rows = []
    for name, shape in result["shapes"].items():
        for side in PEER_SIDES:
            if side != "jppo" and shape.get(f"{side}_s_per_step") is None:
                continue  # not run (not installed, hidden)
            phases, step = shape[f"{side}_phases_s"], shape[f"{side}_s_per_step"] or 0.0
            values = [phases.get(keys[side != "jppo"]) or 0.0 for keys in PEER_PHASES.values()]
            rounds = ", ".join(_num(r.get(side), 3) for r in shape.get("rounds_s_per_step", []))
            alone = [r["trl_alone"] for r in shape.get("rounds_s_per_step", []) if "trl_alone" in r]
            if side == "trl" and alone:
                rounds += " (alone: " + ", ".join(_num(x, 3) for x in alone) + ")"
            ratio = "" if side == "jppo" else _num(shape[f"{side}_over_jppo"], 2)
            rows.append([name, side, f"{step:.3f}", *(f"{v:.3f}" for v in values), f"{step - sum(values):.3f}", rounds,
                         ratio])
    columns = ["shape", "side", "step", *PEER_PHASES, "rest", "rounds (s/step)", "peer / jppo"]
    return _grid(columns, rows, align="llr" + "r" * len(PEER_PHASES) + "rlr")


def _accelerator(result: dict) -> list[str]:
    update, decode, peak = result["update"], result["decode"], result["device_peak_bytes"]
    batch = update["batch"]
    return [
        f"## Accelerator ({result['device_kind']})",
        "",
        f"- update step, {update['parameters']:,} parameters, bf16 compute (float32 master weights), "
        f"{batch['rows']} x {batch['length']} tokens: {update['step']['median_s']:.3f} s, "
        f"{update['tokens_per_s']:,.0f} tokens/s, {update['achieved_flops_per_s'] / 1e12:.3g} model TFLOP/s, "
        f"MFU {_num(update['mfu'])}",
        f"- decode, batch {decode['batch']}: {decode['decode_step_s'] * 1e3:.2f} ms per step, "
        f"{decode['tokens_per_s']:,.0f} tokens/s; roofline {_num(decode['roofline_tokens_per_s'], 0)} tokens/s "
        f"({decode['parameter_bytes'] / MIB:,.1f} MiB of weights read per step); "
        f"fraction of roofline {_num(decode['fraction_of_roofline'])}",
        f"- device peak memory: {'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'}",
        "",
    ]


def _batching(result: dict) -> list[str]:
    cb, sp = result["continuous_batching"], result["shared_prefix"]
    work, shape = cb["workload"], sp["shape"]
    lengths = work["measured_lengths"]
    return _table(
        "Sampler batching: continuous batching on a long-tailed workload",
        f"{work['rows']} rows ({work['prompts']} prompts x {work['n']}), lengths {work['length_distribution']} "
        f"(measured: mean {lengths['mean']:.0f}, median {lengths['median']:.0f}, p90 {lengths['p90']:.0f}, "
        f"{lengths['at_cap'] * 100:.1f}% at the cap); {work['model']['num_layers']} layers "
        f"d{work['model']['hidden_size']}; continuous = {work['max_num_seqs']} slots. Same tokens both ways: "
        f"{cb['same_tokens']}.",
        ["mode", "useful row-steps", "row-steps decoded", "median s", "tokens/s"],
        [[name, _num(cb[name]["useful_slot_fraction"]), f"{cb[name]['decode_slots']:,}", _num(cb[name]["median_s"]),
          _num(cb[name]["tokens_per_s"], 0)] for name in ("all_rows", "continuous")],
    ) + _table(
        "Sampler batching: one prompt block for n samples",
        f"{shape['prompts']} prompts of {shape['prompt']:,} tokens x n = {shape['n']}, {shape['max_new']} new tokens "
        f"(no EOS), {shape['layers']} layers d{shape['hidden']}; copied = each sample with a prompt block of its own. "
        f"Same tokens: {sp['same_tokens']}.",
        ["layout", "cache MiB", "prompt block MiB", "response block MiB", "XLA temp MiB", "median s"],
        [[name, *(f"{sp[name][key] / MIB:,.1f}" for key in ("cache_bytes", "prompt_cache_bytes",
                                                             "response_cache_bytes", "xla_temp_bytes")),
          _num(sp[name]["median_s"])] for name in ("one_block", "block_per_sample")],
    )


SECTIONS: dict[str, Callable[[dict], list[str]]] = {
    "batching": _batching,
    "accumulation": _accumulation,
    "update_vs_torch": _update_vs_torch,
    "sampler": _sampler,
    "rollout_shapes": _rollout_shapes,
    "end_to_end": _end_to_end,
    "peers": _peers,
    "accelerator": _accelerator,
}


def section(name: str, result: dict) -> str:
    """One benchmark's result (what its ``measure`` returned) as a Markdown section."""
    if name not in SECTIONS:
        raise KeyError(f"no report section for benchmark {name!r}; known: {', '.join(SECTIONS)}")
    return "\n".join(SECTIONS[name](result))


def command(name: str, doc: str, measure: Callable[[bool, int], dict], repeats: int = 5) -> None:
    """A benchmark's own command line, ``python -m bench.NAME [--quick] [--repeats N]``: its section, printed."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: CI's smoke run (numbers mean nothing)")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"timed rounds after a warm-up ({repeats})")
    args = parser.parse_args()
    print(section(name, measure(args.quick, args.repeats)))


def render(results: dict) -> str:
    """The whole ``results.md``: machine and versions, the headline ratios, then each benchmark's section."""
    parts = ["\n".join(_header(results) + _headline_table(results))]
    parts += [section(name, results["benchmarks"][name]) for name in SECTIONS if name in results["benchmarks"]]
    return "\n".join(parts)


def finite(tree):
    """``tree`` with NaN and infinities as None (JSON has no such numbers), and every key a string."""
    if isinstance(tree, dict):
        return {str(key): finite(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [finite(value) for value in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree


def write(results: dict, out: pathlib.Path) -> None:
    """``results.json`` and ``results.md`` in ``out``."""
    results = finite(results)
    (out / "results.json").write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    (out / "results.md").write_text(render(results))
