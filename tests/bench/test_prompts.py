from bench.prompts import FixedPrompt, PrefixWorkload, tokenizer_counter


def test_same_group_same_prefix_unique_questions():
    workload = PrefixWorkload(groups=3, prefix_tokens=200, question_tokens=20, seed=1)
    prompts = [workload.prompt(i) for i in range(30)]
    assert [p.group for p in prompts[:4]] == [0, 1, 2, 0]
    for p in prompts:
        assert p.text.startswith(workload.prefixes[p.group])
    assert len(set(workload.prefixes)) == 3
    assert len({p.text for p in prompts}) == 30
    questions = {p.text[len(workload.prefixes[p.group]) :] for p in prompts}
    assert len(questions) == 30
    assert len(workload.prefixes[0].split()) == 200  # one word per token without a tokenizer


def test_prompts_depend_only_on_seed_and_index():
    a, b = PrefixWorkload(2, 50, 10, seed=7), PrefixWorkload(2, 50, 10, seed=7)
    assert [a.prompt(i).text for i in (5, 0, 3)] == [b.prompt(i).text for i in (5, 0, 3)]
    assert PrefixWorkload(2, 50, 10, seed=8).prompt(0).text != a.prompt(0).text


def test_fixed_prompt():
    assert FixedPrompt("Hi").prompt(9).text == "Hi"


def test_tokenizer_counts_are_close(default_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    workload = PrefixWorkload(2, 300, 40, count_tokens=tokenizer_counter(default_model))
    prefix_ids = tokenizer.encode(workload.prefixes[1], add_special_tokens=False)
    assert 300 <= len(prefix_ids) <= 304  # + capital letter, full stop, newline
    prompt_ids = tokenizer.encode(workload.prompt(1).text, add_special_tokens=False)
    assert prompt_ids[: len(prefix_ids)] == prefix_ids  # the question does not change the prefix's tokens
    assert 30 <= len(prompt_ids) - len(prefix_ids) <= 50
