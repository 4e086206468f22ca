"""Tokenizers, built-in tasks, reasoning-gym tasks, prompt files and resumable batching (jppo.data)."""

import json
import random
import re
import sys
import zlib

import jinja2
import pytest
import tokenizers

from jppo.config import ConfigError, load_config
from jppo.data import (
    CharTokenizer,
    DataConfig,
    Example,
    HFTokenizer,
    get_task,
    load_dataset,
    load_tokenizer,
    prepare_gsm8k,
    task_of,
    tasks,
)

# ---------------------------------------------------------------------------------------------------------------
# Tokenizers

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} {{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{% generation %}<|assistant|>{% endgeneration %}{% endif %}"
)
WORDS = ["hello", "world", "how", "are", "you", "be", "brief", "3+4=", "7"]
SPECIALS = ["<pad>", "<s>", "</s>", "<|end|>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]


def write_hf_tokenizer(directory, tokenizer_config, generation_config=None, config=None):
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    files = {"tokenizer_config.json": tokenizer_config, "generation_config.json": generation_config,
             "config.json": config}
    for name, content in files.items():
        if content is not None:
            (directory / name).write_text(json.dumps(content))
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    config = {
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},  # serialized AddedToken form
        "pad_token": None,
        "chat_template": TEMPLATE,
    }
    return write_hf_tokenizer(tmp_path_factory.mktemp("hf"), config, generation_config={"eos_token_id": [2, 3]})


def test_char_tokenizer_round_trip_and_specials():
    tok = CharTokenizer("0123456789=")
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.eos_ids, tok.vocab_size) == (0, 1, 2, (2,), 14)
    assert tok.encode("3051=") == [6, 3, 8, 4, 13]
    assert tok.encode("3051=", add_special_tokens=True) == [1, 6, 3, 8, 4, 13]
    assert tok.decode([1, 6, 3, 8, 4, 13, 2, 0, 0]) == "3051="
    assert tok.decode([1, 6, 2, 0], skip_special=False) == "<bos>3<eos><pad>"
    assert tok.encode("") == [] and tok.decode([]) == ""
    assert tok.decode([6, 14, 3, -1]) == "3\ufffd0\ufffd"  # ids past the vocabulary are visibly wrong, not dropped


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: CharTokenizer("01=").encode("0a1b"), r"\['a', 'b'\].*not in the tokenizer alphabet '01='"),
        (lambda: CharTokenizer("0110"), r"repeats the characters \['0', '1'\]"),
        (lambda: CharTokenizer(""), "alphabet is empty"),
        (lambda: CharTokenizer("01").apply_chat_template([{"role": "user", "content": "1"}]), "no chat template"),
        (lambda: load_tokenizer("builtin:nope"),
         r"'builtin:nope' \(model.tokenizer\): task 'nope' has no built-in vocabulary"),
        (lambda: load_tokenizer("/no/such/dir"), "neither 'builtin:<task>' nor an existing directory"),
    ],
)
def test_char_tokenizer_and_loader_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_load_builtin_tokenizer_uses_the_task_alphabet():
    tok = load_tokenizer("builtin:add_small")
    assert isinstance(tok, CharTokenizer) and tok.decode(tok.encode("17+5=")) == "17+5="
    assert tok.vocab_size == 3 + len("0123456789+=")


def test_hf_tokenizer_special_tokens_round_trip(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    # eos: tokenizer_config's first, then generation_config's extra id; no pad anywhere -> the eos id.
    assert (tok.bos_id, tok.eos_id, tok.eos_ids, tok.pad_id) == (1, 2, (2, 3), 2)
    assert tok.vocab_size == len(SPECIALS) + len(WORDS)
    ids = tok.encode("hello world")
    assert ids == [8, 9]
    assert tok.encode("hello world", add_special_tokens=True) == [1, 8, 9]  # the post-processor's BOS
    assert tok.decode(ids + [2, 0]) == "hello world"
    assert tok.decode([1] + ids + [2], skip_special=False) == "<s> hello world </s>"


def test_chat_template_matches_handwritten_and_transformers(hf_dir):
    tok = HFTokenizer.from_dir(hf_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4="}]
    expected = "<s><|system|> be brief </s>\n<|user|> 3+4= </s>\n<|assistant|>"
    assert tok.apply_chat_template(messages) == expected
    import transformers

    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    assert reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    ids = tok.encode(expected)  # rendered special tokens become their ids, with no second BOS
    assert ids[:2] == [1, 7] and ids.count(1) == 1
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_hf_tokenizer_config_variants(tmp_path):
    # No tokenizer_config: eos and pad from config.json; the template from chat_template.jinja; no bos.
    directory = write_hf_tokenizer(tmp_path / "a", None, config={"eos_token_id": 3, "pad_token_id": 0})
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}|{{ eos_token }}")
    tok = HFTokenizer.from_dir(directory)
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (None, (3,), 0)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi|<|end|>"
    # Named templates: the "default" one is used.
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
    directory = write_hf_tokenizer(tmp_path / "b", {"eos_token": "</s>", "bos_token": "<s>", "chat_template": named})
    assert HFTokenizer.from_dir(directory).apply_chat_template([]) == "D<s>"


@pytest.mark.parametrize(
    "tokenizer_config, message",
    [
        ({"bos_token": "<s>"}, "has no EOS token"),
        ({"eos_token": "<nope>"}, r"eos_token='<nope>' is not in the vocabulary"),
        ({"eos_token": "</s>"}, "has no chat template"),
    ],
)
def test_hf_tokenizer_errors(tmp_path, tokenizer_config, message):
    directory = write_hf_tokenizer(tmp_path, tokenizer_config)
    with pytest.raises(ValueError, match=message):
        HFTokenizer.from_dir(directory).apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_tokenizer_missing_file(tmp_path):
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Built-in tasks


@pytest.mark.parametrize("name", ["reverse_digits", "add_small"])
def test_generated_tasks_are_deterministic_and_splits_disjoint(name):
    task = get_task(name)
    train = task.examples("train", 3000, seed=7)
    assert train == task.examples("train", 3000, seed=7)
    assert [e.prompt for e in task.examples("train", 50, seed=8)] != [e.prompt for e in train[:50]]
    val_prompts = {e.prompt for seed in (7, 8) for e in task.examples("val", 300, seed=seed)}
    assert len(val_prompts) > 100 and not val_prompts & {e.prompt for e in train}
    assert len(train) == 3000 and task.examples("val", 0, seed=7) == []


def test_reverse_digits_examples_follow_the_format():
    task = get_task("reverse_digits", {"min_len": 2, "max_len": 4})
    examples = task.examples("train", 400, seed=0)
    for example in examples:
        assert re.fullmatch(r"[0-9]{2,4}=", example.prompt) and example.answer == example.prompt[:-1][::-1]
    assert {len(e.answer) for e in examples} == {2, 3, 4}


def test_add_small_examples_are_sums():
    for example in get_task("add_small", {"max_operand": 9}).examples("train", 200, seed=1):
        a, b = re.fullmatch(r"(\d)\+(\d)=", example.prompt).groups()
        assert example.answer == str(int(a) + int(b))


@pytest.mark.parametrize(
    "response, finished, expected",
    [
        ("1503", True, 1.0),
        ("1503", False, 1.0),  # cut at the length limit: stopping is not scored
        ("1509", True, 0.75),  # one wrong digit
        ("15030", True, 1.0),  # what follows the answer is ignored
        ("15", True, 0.5),  # an early stop loses the missing digits
        ("", True, 0.0),
        ("3051", True, 0.0),
        ("x5", False, 0.25),
    ],
)
def test_reverse_digits_score(response, finished, expected):
    example = Example(prompt="3051=", answer="1503")
    task = get_task("reverse_digits")
    assert task.score(response, example, finished) == pytest.approx(expected, abs=1e-12)
    credit = task.credit(response, example, finished)
    assert len(credit) == len(response) + finished and sum(credit) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "response, expected",
    [("102", 1.0), ("112", 2 / 3), ("92", 0.0), ("1020", 1.0), ("", 0.0)],
)
def test_add_small_score_matches_the_sum_left_to_right(response, expected):
    example = Example(prompt="68+34=", answer="102")
    assert get_task("add_small").score(response, example) == pytest.approx(expected, abs=1e-12)


def test_random_policy_sometimes_earns_reward():
    # A uniform policy over the 11 characters and EOS, as an untrained model roughly is.
    task, rng = get_task("reverse_digits"), random.Random(0)
    examples = task.examples("train", 300, seed=0)
    rewards = []
    for example in examples:
        response = ""
        while len(response) < 8 and (token := rng.randrange(12)) < 11:
            response += task.alphabet[token]
        rewards.append(task.score(response, example))
    assert 0.01 < sum(rewards) / len(rewards) < 0.2 and max(rewards) > 0


def test_task_format_checks():
    task = get_task("reverse_digits")
    assert task.follows_format("0123") and not task.follows_format("01=") and not task.follows_format("")


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("reverse_digits", {"min_length": 3}, r"\['min_length'\] are not options of .*: \['max_len', 'min_len'\]"),
        ("reverse_digits", {"min_len": 4, "max_len": 3}, "min_len=4, max_len=3 are invalid"),
        ("add_small", {"max_operand": 0}, "max_operand=0 is invalid"),
        ("sort_words", None, "data.task='sort_words' is unknown"),
    ],
)
def test_task_option_errors(name, options, message):
    with pytest.raises(ValueError, match=message):
        get_task(name, options)


def test_split_without_enough_prompts_is_an_error():
    assert zlib.crc32(b"7=") % 10 != 0  # "7=" is a training prompt
    with pytest.raises(ValueError, match="too few distinct prompts for a val split"):
        tasks._generate("t", "val", 3, 0, lambda rng: ("7=", "7"))
    with pytest.raises(ValueError, match=r"split='test' is invalid: valid splits are \['train', 'val'\]"):
        get_task("reverse_digits").examples("test", 1, 0)


# ---------------------------------------------------------------------------------------------------------------
# reasoning-gym (a test dependency)


@pytest.fixture(scope="module")
def arithmetic():
    return get_task("reasoning_gym:basic_arithmetic", {"min_terms": 2, "max_terms": 2})


def test_reasoning_gym_task_generates_and_scores(arithmetic):
    train = arithmetic.examples("train", 40, seed=3)
    assert train == arithmetic.examples("train", 40, seed=3) and arithmetic.alphabet is None
    val = arithmetic.examples("val", 20, seed=3)
    assert not {e.prompt for e in val} & {e.prompt for e in train}
    example = train[0]
    assert example.prompt.endswith("</answer>.") and example.meta["entry"]["answer"] == example.answer
    assert arithmetic.score(f"it is <answer> {example.answer} </answer>", example) == 1.0
    assert arithmetic.score("<answer>twelve</answer>", example) == 0.0
    assert arithmetic.score(example.answer, example) == 0.0  # no answer tags, no answer
    assert arithmetic.follows_format("<answer>1</answer>") and not arithmetic.follows_format("<answer>1")


def test_reasoning_gym_errors(monkeypatch):
    with pytest.raises(ValueError, match="reasoning-gym has no dataset 'no_such_set'; valid datasets: .*basic_arith"):
        get_task("reasoning_gym:no_such_set")
    with pytest.raises(ValueError, match=r"\['digits'\] are not options of reasoning-gym dataset 'basic_arithmetic'"):
        get_task("reasoning_gym:basic_arithmetic", {"digits": 3})
    with pytest.raises(ValueError, match="has no built-in vocabulary"):
        load_tokenizer("builtin:reasoning_gym:basic_arithmetic")
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(ValueError, match=r"needs the optional package reasoning-gym: pip install 'jppo\[tasks\]'"):
        get_task("reasoning_gym:basic_arithmetic")


# ---------------------------------------------------------------------------------------------------------------
# Datasets and batching


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"truncation": "right"}, r"data.truncation='right' is invalid: valid values are \['error', 'left'\]"),
        ({"train_batch_size": 0}, "data.train_batch_size=0 is invalid"),
        ({"task": "files"}, "data.task='files' needs data.train_files"),
    ],
)
def test_data_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**fields)


def test_an_unknown_task_is_refused_with_the_config():
    """The task's name against the registry: jppo.data.tasks registers the check that load_config runs (the record,
    in jppo.core, knows no registry)."""
    with pytest.raises(ConfigError, match=r"^data.task='reverse' is unknown; valid tasks: .*'files'$"):
        load_config(None, ["data.task=reverse"])


def test_builtin_dataset_tokenizes_once_with_bos():
    tok = CharTokenizer("0123456789=")
    dataset = load_dataset(DataConfig(num_val_examples=5), tok, "val")
    assert len(dataset) == 5 and not dataset.shuffle
    for example, ids in zip(dataset.examples, dataset.prompt_ids):
        assert ids[0] == tok.bos_id and tok.decode(ids) == example.prompt
    batches = list(dataset.batches(2))
    assert [len(b[0]) for b in batches] == [2, 2, 1] and [e for b in batches for e in b[0]] == dataset.examples


def small_dataset(shuffle=True, n=10):
    cfg = DataConfig(num_train_examples=n, shuffle=shuffle)
    return load_dataset(cfg, CharTokenizer("0123456789="), "train")


def test_batch_at_resumes_exactly_from_the_position():
    dataset = small_dataset()
    position, run = 0, []
    for _ in range(7):  # 7 batches of 4 from 10 examples: crosses two epoch boundaries mid-batch
        examples, ids, position = dataset.batch_at(position, 4, seed=5)
        run.append((examples, ids))
    assert position == 28
    resumed, position = [], 12  # a fresh process that saved position 12 after three batches
    for _ in range(4):
        examples, ids, position = small_dataset().batch_at(position, 4, seed=5)
        resumed.append((examples, ids))
    assert resumed == run[3:]


def test_batch_at_visits_every_example_once_per_epoch_and_reshuffles():
    dataset = small_dataset()
    stream = [e.prompt for p in range(0, 30, 3) for e in dataset.batch_at(p, 3, seed=1)[0]]
    epochs = [stream[0:10], stream[10:20], stream[20:30]]
    for epoch in epochs:
        assert sorted(epoch) == sorted(e.prompt for e in dataset.examples)
    assert epochs[0] != epochs[1] != epochs[2]
    other_seed = [e.prompt for e in dataset.batch_at(0, 10, seed=2)[0]]
    assert other_seed != epochs[0]
    in_order = small_dataset(shuffle=False).batch_at(8, 4, seed=1)[0]
    assert in_order == [dataset.examples[i] for i in (8, 9, 0, 1)]


def test_batch_larger_than_dataset_wraps():
    dataset = small_dataset(n=3)
    examples, ids, position = dataset.batch_at(2, 7, seed=0)
    assert len(examples) == len(ids) == 7 and position == 9
    with pytest.raises(ValueError, match="need position >= 0, batch_size >= 1"):
        dataset.batch_at(-1, 2, seed=0)


def write_jsonl(path, rows, blank_line_at=None):
    lines = [json.dumps(row) for row in rows]
    if blank_line_at is not None:
        lines.insert(blank_line_at, "")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def files_config(train, **fields):
    return DataConfig(task="files", train_files=train, max_prompt_length=64, **fields)


def test_jsonl_files_with_strings_numbers_and_nested_keys(tmp_path):
    tok = CharTokenizer("0123456789+= ")
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "1+1=", "answer": 2, "id": 7}], blank_line_at=0)
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "2+2=", "answer": "so #### 4"}])
    dataset = load_dataset(files_config(f"{first}, {second}"), tok, "train")
    assert [(e.prompt, e.answer) for e in dataset.examples] == [("1+1=", "2"), ("2+2=", "so #### 4")]
    assert dataset.examples[0].meta == {"id": 7, "location": f"{first} line 2"}
    assert dataset.prompt_ids[0] == tok.encode("1+1=", add_special_tokens=True)
    verl_row = {"prompt": "3+3=", "reward_model": {"ground_truth": "6", "style": "rule"}}
    nested = write_jsonl(tmp_path / "c.jsonl", [verl_row])
    example = load_dataset(files_config(nested, answer_key="reward_model.ground_truth"), tok, "train").examples[0]
    assert example.answer == "6" and example.meta["reward_model"]["style"] == "rule"


def test_chat_messages_rows_use_the_template(tmp_path, hf_dir):
    tok = HFTokenizer.from_dir(hf_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4="}]
    rows = [{"prompt": messages, "answer": "7"}, {"prompt": "how are you", "answer": "7"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    dataset = load_dataset(files_config(path, apply_chat_template=True), tok, "train")
    first, second = dataset.examples
    assert first.prompt == "3+4=" and first.messages == messages and second.messages is None
    first_text = "<s> <|system|> be brief </s> <|user|> 3+4= </s> <|assistant|>"
    assert tok.decode(dataset.prompt_ids[0], skip_special=False) == first_text
    assert tok.decode(dataset.prompt_ids[1], skip_special=False) == "<s> <|user|> how are you </s> <|assistant|>"
    message = rf"{re.escape(path)} line 1 has chat messages as its prompt: set data.apply_chat_template=true"
    with pytest.raises(ValueError, match=message):
        load_dataset(files_config(path), tok, "train")


def test_a_list_of_files_gives_every_files_rows_in_order(tmp_path):
    tok = CharTokenizer("0123456789+=")
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+2=", "answer": "3"}])
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    dataset = load_dataset(files_config([second, first]), tok, "train")
    assert [e.prompt for e in dataset.examples] == ["2+2=", "1+1=", "1+2="]
    assert [e.meta["location"] for e in dataset.examples] == [f"{second} line 1", f"{first} line 1", f"{first} line 2"]
    val = load_dataset(files_config(first, val_files=[first, second]), tok, "val")
    assert [e.answer for e in val.examples] == ["2", "3", "4"]


THINKING_TEMPLATE = (
    "{% for message in messages %}<|user|> {{ message['content'] }} {% endfor %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %} hello{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(tmp_path):
    directory = write_hf_tokenizer(tmp_path / "hf", {"eos_token": "</s>", "chat_template": THINKING_TEMPLATE})
    tok = HFTokenizer.from_dir(directory)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "how are you", "answer": "7"}])
    plain = load_dataset(files_config(path, apply_chat_template=True), tok, "train")
    off = files_config(path, apply_chat_template=True, apply_chat_template_kwargs={"enable_thinking": False})
    no_thinking = load_dataset(off, tok, "train")
    assert tok.decode(plain.prompt_ids[0], skip_special=False) == "<|user|> how are you <|assistant|>"
    assert tok.decode(no_thinking.prompt_ids[0], skip_special=False) == "<|user|> how are you <|assistant|> hello"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"train_files": 3}, "data.train_files=3 is invalid: give a path, comma-separated paths, or a list of paths"),
        ({"val_files": {"a": 1}}, "data.val_files={'a': 1} is invalid"),
        ({"train_files": ["a.jsonl", 3]}, r"data.train_files=\['a.jsonl', 3\] is invalid: every item of the list"),
        ({"train_files": []}, "data.task='files' needs data.train_files"),
        ({"apply_chat_template_kwargs": {"enable_thinking": False}}, "needs data.apply_chat_template=true"),
        ({"apply_chat_template": True, "apply_chat_template_kwargs": {"messages": []}}, "sets 'messages', which jppo"),
        ({"apply_chat_template": True, "apply_chat_template_kwargs": {1: 2}}, "has the key 1: template variable"),
    ],
)
def test_file_list_and_template_kwargs_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**{"task": "files", "train_files": "a.jsonl", **fields})


def test_prompt_length_limit_errors_or_truncates_left(tmp_path):
    tok = CharTokenizer("0123456789=")
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "12345=", "answer": "1"}])
    message = rf"{re.escape(path)} line 1 has 7 tokens > data.max_prompt_length=4 .*data.truncation=left"
    with pytest.raises(ValueError, match=message):
        load_dataset(DataConfig(task="files", train_files=path, max_prompt_length=4), tok, "train")
    cfg = DataConfig(task="files", train_files=path, max_prompt_length=4, truncation="left")
    dataset = load_dataset(cfg, tok, "train")
    assert tok.decode(dataset.prompt_ids[0]) == "345="


@pytest.mark.parametrize(
    "content, error, message",
    [
        ('{"prompt": "1="}\n', KeyError, r"bad.jsonl line 1 has no key 'answer' \(data.answer_key\); .* \['prompt'\]"),
        ('{"answer": "1"}\n\n{"prompt": "1=", "answer": "1"}\n', KeyError, "bad.jsonl line 1 has no key 'prompt'"),
        ('{"prompt": "1=", "answer": "1"}\n{"prompt": \n', ValueError, "bad.jsonl line 2 is not valid JSON"),
        ('["1=", "1"]\n', ValueError, "bad.jsonl line 1 is a JSON list, not an object"),
        ('{"prompt": 5, "answer": "1"}\n', ValueError, "bad.jsonl line 1: prompt 'prompt' is a int"),
        ('{"prompt": "1=", "answer": [1]}\n', ValueError, "bad.jsonl line 1: answer 'answer' is a list"),
        ('{"prompt": [{"role": "user"}], "answer": "1"}\n', ValueError, r"a string or a list of \{role, content\}"),
    ],
)
def test_bad_rows_name_the_file_row_and_key(tmp_path, content, error, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(error, match=message):
        load_dataset(files_config(str(path)), CharTokenizer("0123456789="), "train")


def test_file_errors(tmp_path):
    tok = CharTokenizer("0123456789=")
    with pytest.raises(ValueError, match=r"data.train_files: file '/no/such.jsonl' does not exist"):
        load_dataset(files_config("/no/such.jsonl"), tok, "train")
    good = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "1=", "answer": "1"}])
    with pytest.raises(ValueError, match=r"data.val_files: file '/no/val.jsonl' does not exist"):
        load_dataset(files_config(good, val_files="/no/val.jsonl"), tok, "val")
    with pytest.raises(ValueError, match="data.val_files is not set"):
        load_dataset(files_config(good), tok, "val")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"data.train_files='.*empty.jsonl' holds no rows"):
        load_dataset(files_config(str(empty)), tok, "train")
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"has suffix '.csv'; valid suffixes: .jsonl, .parquet"):
        load_dataset(files_config(str(csv)), tok, "train")
    assert task_of(files_config(good)) is None


def test_parquet_files_and_missing_pyarrow(tmp_path, monkeypatch):
    import pyarrow
    import pyarrow.parquet

    rows = [{"prompt": "12=", "answer": "21"}, {"prompt": "305=", "answer": "503"}]
    path = str(tmp_path / "rows.parquet")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    dataset = load_dataset(files_config(path), CharTokenizer("0123456789="), "train")
    assert [(e.prompt, e.answer) for e in dataset.examples] == [("12=", "21"), ("305=", "503")]
    assert dataset.examples[1].meta["location"] == f"{path} row 2"
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match="needs pyarrow: pip install pyarrow"):
        load_dataset(files_config(path), CharTokenizer("0123456789="), "train")


GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box holds 1,200 pens; 200 are sold. Left?", "answer": "1200 - 200 = 1000\n#### 1,000"},
]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_prepare_gsm8k_converts_rows(tmp_path, suffix, capsys):
    source = tmp_path / f"gsm8k.{suffix}"
    if suffix == "jsonl":
        write_jsonl(source, GSM8K_ROWS)
    else:
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(GSM8K_ROWS), str(source))
    output = tmp_path / "data" / "gsm8k" / "out.jsonl"  # a folder that does not exist yet, as on a fresh clone
    prepare_gsm8k.main([str(source), str(output)])
    assert "wrote 2 examples" in capsys.readouterr().out
    converted = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["answer"] for row in converted] == [row["answer"] for row in GSM8K_ROWS]
    assert converted[0]["prompt"] == GSM8K_ROWS[0]["question"] + prepare_gsm8k.INSTRUCTION
    assert "####" in prepare_gsm8k.INSTRUCTION


def test_prepare_gsm8k_errors(tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"s.jsonl row 1: answer has no '####' final-answer marker"):
        prepare_gsm8k.convert(source, str(tmp_path / "o.jsonl"))
    source = write_jsonl(tmp_path / "t.jsonl", [{"question": "q"}])
    with pytest.raises(KeyError, match=r"t.jsonl row 1 has no text under \['answer'\]"):
        prepare_gsm8k.convert(source, str(tmp_path / "o.jsonl"))


@pytest.mark.parametrize("make_args, message", [
    (lambda tmp: [str(tmp / "missing.jsonl"), str(tmp / "o.jsonl")], "the input SRC: file '"),
    (lambda tmp: [str(write_jsonl(tmp / "t.jsonl", [{"question": "q"}])), str(tmp / "o.jsonl")],
     "t.jsonl row 1 has no text under ['answer']"),
    (lambda tmp: [str(write_jsonl(tmp / "g.jsonl", GSM8K_ROWS)), str(tmp / "g.jsonl" / "o.jsonl")],
     "the output OUT"),
])
def test_prepare_gsm8k_cli_refuses_in_one_line(tmp_path, capsys, make_args, message):
    assert prepare_gsm8k.main(make_args(tmp_path)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prepare_gsm8k: error: ") and message in lines[0], lines
