"""The single-turn built-in environments (reverse-words, a JSONL file), their rewards, chat
rendering, and --reward-file loading."""

from __future__ import annotations

import json
import math

import pytest

from gridrl.common.errors import StatusError
from gridrl.trainer import rewards
from gridrl.trainer.envs import chat, similarity
from gridrl.trainer.envs.loading import make_environment
from gridrl.trainer.envs.reverse import ReverseWords


def test_word_similarity_is_one_only_for_the_exact_reversal():
    assert similarity.word_similarity("sky blue cat", "sky blue cat") == 1.0
    assert similarity.word_similarity("  Sky, blue cat.", "sky blue cat") == 1.0  # case/punctuation
    # 2 of 3 words in order: 2*2/(2+3) = 0.8
    assert similarity.word_similarity("sky cat", "sky blue cat") == pytest.approx(0.8)
    # the original order (not reversed) of 3 distinct words matches 1 word: 2*1/6
    assert similarity.word_similarity("cat blue sky", "sky blue cat") == pytest.approx(1 / 3)
    assert similarity.word_similarity("", "sky blue cat") == 0.0
    assert similarity.word_similarity("sky blue cat cat", "sky blue cat") < 1.0


def test_reverse_words_items_are_deterministic_and_sized():
    t = ReverseWords(seed=3, min_words=3, max_words=4, eval_size=16)
    a = [t.train_item(i) for i in range(50)]
    b = [ReverseWords(seed=3, min_words=3, max_words=4).train_item(i) for i in range(50)]
    assert a == b
    for item in a:
        words = item.prompt.removeprefix("Words: ").split()
        assert 3 <= len(words) <= 4 and len(set(words)) == len(words)
        assert item.columns["answer"] == " ".join(reversed(words))
        assert item.messages[0]["role"] == "system" and "Example" in item.messages[0]["content"]
        assert item.messages[1] == {"role": "user", "content": item.prompt}
    other_seed = [ReverseWords(seed=4, min_words=3, max_words=4).train_item(i)
                  for i in range(50)]
    assert other_seed != a


def test_reverse_words_eval_set_is_fixed_and_disjoint_from_training():
    t = ReverseWords(seed=0, min_words=3, max_words=3, eval_size=40)
    evals = t.eval_items()
    assert len(evals) == 40 and len({e.prompt for e in evals}) == 40
    assert evals == ReverseWords(seed=99, min_words=3, max_words=3, eval_size=40).eval_items()
    held = {e.prompt for e in evals}
    assert not held & {t.train_item(i).prompt for i in range(3000)}


def test_reverse_words_score_and_bad_ranges():
    t = ReverseWords()
    item = t.train_item(0)
    answer = item.columns["answer"]
    assert t.score([item.prompt], [answer], answer=[answer]) == [1.0]
    assert t.score([item.prompt], ["nothing"], answer=[answer]) == [0.0]
    with pytest.raises(StatusError, match="--min-words"):
        ReverseWords(min_words=5, max_words=4)


def test_jsonl_env_split_epochs_and_columns(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"question {i}", "a": f"answer {i}", "level": i})
                              for i in range(20)) + "\n")
    t = make_environment(str(path), seed=1, eval_size=5, prompt_column="q", answer_column="a")
    evals = t.eval_items()
    assert len(evals) == 5
    first_epoch = [t.train_item(i).prompt for i in range(15)]
    assert len(set(first_epoch)) == 15  # one epoch visits every training row once
    assert not set(first_epoch) & {e.prompt for e in evals}
    second_epoch = [t.train_item(i).prompt for i in range(15, 30)]
    assert sorted(second_epoch) == sorted(first_epoch) and second_epoch != first_epoch
    item = t.train_item(0)
    assert item.columns["answer"] == item.columns["a"] and "level" in item.columns
    assert t.score([item.prompt], [item.columns["a"]], **{"answer": [item.columns["a"]]}) == [1.0]


def test_jsonl_env_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(StatusError, match=r"bad.jsonl:2"):
        make_environment(str(bad), seed=0, eval_size=1)
    small = tmp_path / "small.jsonl"
    small.write_text('{"prompt": "x", "answer": "y"}\n')
    with pytest.raises(StatusError, match="hold out"):
        make_environment(str(small), seed=0, eval_size=1)
    with pytest.raises(StatusError, match="--task"):
        make_environment("no-such-task", seed=0, eval_size=1)


def test_prompt_ids_use_the_template_and_folds_system_when_rejected(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    msgs = [{"role": "system", "content": "reverse words"}, {"role": "user", "content": "cat dog"}]
    ids = chat.prompt_ids(tok, msgs)
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False,
                                                      add_generation_prompt=True).strip()
    assert tok.convert_ids_to_tokens(ids[-1]) == "<|assistant|>"
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
                         "<|assistant|>")
    folded = tok.decode(chat.prompt_ids(tok, msgs))
    assert folded.startswith("<|user|> reverse words") and "cat dog" in folded
    tok.chat_template = None
    with pytest.raises(StatusError, match="chat template"):
        chat.prompt_ids(tok, msgs)


REWARD_FILE = '''
from gridrl.trainer.envs.similarity import similarity_reward

def brevity(prompts, completions, **kwargs):
    return [1.0 if len(c.split()) <= 3 else 0.0 for c in completions]

def only_long(prompts, completions, answer):
    return [None if len(a.split()) < 3 else 0.5 for a in answer]

def _helper():
    return 1
'''


def test_reward_file_loading_and_weighted_nansum(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARD_FILE)
    funcs = rewards.load_reward_file(path)
    assert [n for n, _ in funcs] == ["brevity", "only_long"]  # imported / private ones skipped
    rs = rewards.RewardSet(funcs, rewards.parse_weights("2,1", 2))
    total, per = rs(["p1", "p2"], ["a b", "a b c d"],
                    {"answer": ["x y", "x y z"], "completion_ids": [[1], [2]]})
    assert per["brevity"] == [1.0, 0.0]
    assert math.isnan(per["only_long"][0]) and per["only_long"][1] == 0.5
    assert total == [2.0, 0.5]


def test_reward_file_with_reward_funcs_list_and_builtin(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(REWARD_FILE + "\nREWARD_FUNCS = [similarity_reward, 'brevity']\n")
    rs = rewards.build_reward_set(ReverseWords(), [str(path)], "1,0.5")
    assert rs.names == ["similarity_reward", "brevity"]
    total, _ = rs(["p"], ["c b a"], {"answer": ["c b a"]})
    assert total == [1.5]


def test_reward_errors(tmp_path):
    with pytest.raises(StatusError, match="--reward-file"):
        rewards.load_reward_file(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(StatusError, match="import failed"):
        rewards.load_reward_file(broken)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def f(x):\n    return [0.0]\n")
    with pytest.raises(StatusError, match="must accept"):
        rewards.load_reward_file(wrong)
    with pytest.raises(StatusError, match="--reward-weights"):
        rewards.parse_weights("1,2", 3)
    short = tmp_path / "short.py"
    short.write_text("def f(prompts, completions, **kw):\n    return [0.0]\n")
    rs = rewards.RewardSet(rewards.load_reward_file(short), [1.0])
    with pytest.raises(ValueError, match="returned 1 values for 2"):
        rs(["a", "b"], ["a", "b"], {})


def test_default_rewards_are_the_environment_score():
    rs = rewards.build_reward_set(ReverseWords(), [], None)
    total, per = rs(["p"], ["c b a"], {"answer": ["c b a"]})
    assert per == {"reverse-words:score": [1.0]}
    assert total == [1.0] and rs.names == ["reverse-words:score"]


def test_jsonl_eval_file_is_held_out_from_training(tmp_path):
    train = tmp_path / "train.jsonl"
    evals = tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": f"a{i}"}) + "\n"
                             for i in range(6)))
    evals.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": f"a{i}"}) + "\n"
                             for i in (0, 7)))
    t = make_environment(str(train), seed=0, eval_size=1, eval_file=str(evals),
                        system_prompt="be brief")
    assert [e.prompt for e in t.eval_items()] == ["q0", "q7"]
    seen = {t.train_item(i).prompt for i in range(5)}
    assert seen == {"q1", "q2", "q3", "q4", "q5"}  # q0 is in the eval file: never trained on
    assert t.train_item(0).messages[0] == {"role": "system", "content": "be brief"}
