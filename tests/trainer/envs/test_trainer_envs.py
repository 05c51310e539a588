"""Environments without a model: chat-template deltas, the episode runner (turns, limits, drops,
mask), reverse-words with a second attempt, tool calls, --task loading, JSONL chat rows."""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import pytest

from gridrl.common.errors import StatusError
from gridrl.trainer.envs import chat, episode, loading, reverse, tools
from gridrl.trainer.envs.base import Environment, EnvTurn, TaskItem
from gridrl.trainer.envs.reverse import ReverseWords
from gridrl.trainer.rollouts import EpisodeStats, RolloutSample

SMOLLM2 = Path.home() / ".cache/gridrl/models/smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _ids(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- chat deltas

def _tokenizers(tiny_llama_dir):
    from transformers import AutoTokenizer

    out = [AutoTokenizer.from_pretrained(tiny_llama_dir)]
    if (SMOLLM2 / "tokenizer.json").is_file():
        out.append(AutoTokenizer.from_pretrained(SMOLLM2))
    return out


@pytest.mark.parametrize("stopped", [True, False])
def test_prompt_reply_and_deltas_are_the_rendered_conversation(tiny_llama_dir, stopped):
    """Three model turns and two environment turns: prompt ids + each reply's ids as sampled +
    each delta equal the template's rendering of the whole conversation, tokenized (for these
    templates, where re-tokenizing the replies gives the same ids)."""
    for tok in _tokenizers(tiny_llama_dir):
        history = [{"role": "system", "content": "reverse words"},
                   {"role": "user", "content": "red cat blue"}]
        ids = chat.prompt_ids(tok, history)
        delta = chat.ChatDelta(tok)
        replies = ["blue cat red", "blue red cat", "sky"]
        for k, reply in enumerate(replies):
            reply_ids = _ids(tok, reply) + ([tok.eos_token_id] if stopped else [])
            ids += reply_ids
            if k == len(replies) - 1:
                break
            new = [{"role": "user", "content": f"wrong {k}"}]
            ids += delta.append(history, reply_ids, stopped, new)
            history = [*history, {"role": "assistant", "content": reply}, *new]
        if stopped:
            want = _ids(tok, chat.render(tok, [*history, {"role": "assistant",
                                                          "content": replies[-1]}],
                                         generation_prompt=False))
            assert ids == want[:len(ids)]  # the last turn's closing text is not sampled
        else:  # cut replies: every delta closes the turn itself
            text = chat.render(tok, history, generation_prompt=True)
            assert ids[:len(_ids(tok, text))] == _ids(tok, text)


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_llama_dir):
    """Like Qwen3's template dropping the reasoning of assistant turns before the last user
    message: appending a message changes how the reply renders, so no token-exact delta."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.chat_template = (
        "{% set last = namespace(i=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
        "{% set last.i = loop.index0 %}{% endif %}{% endfor %}"
        "{% for m in messages %}<|{{ m['role'] }}|> "
        "{% if m['role'] == 'assistant' and loop.index0 < last.i %}the"
        "{% else %}{{ m['content'] }}{% endif %} </s> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    history = [{"role": "user", "content": "red cat"}]
    with pytest.raises(chat.TemplateDeltaError, match="earlier turns"):
        chat.ChatDelta(tok).append(history, _ids(tok, "cat red </s>"), True,
                                   [{"role": "user", "content": "again"}])


# --------------------------------------------------------------------------- the runner

class FakeSampler:
    """Replies from a script: each request gets ``replies[turn]`` (ids of a text), stopped."""

    def __init__(self, tok, replies, version=3, fail_turn=None, version_turn=None):
        self.tok, self.replies, self.version = tok, replies, version
        self.fail_turn, self.version_turn = fail_turn, version_turn
        self.requests: list[list[episode.TurnRequest]] = []

    def __call__(self, requests):
        turn = len(self.requests)
        self.requests.append(requests)
        out = []
        for r in requests:
            if self.fail_turn == turn:
                out.append(ConnectionError("node gone"))
                continue
            text = self.replies[min(turn, len(self.replies) - 1)]
            ids = [*_ids(self.tok, text)[:r.max_tokens - 1], self.tok.eos_token_id]
            version = self.version + (turn == self.version_turn)
            out.append([RolloutSample(token_ids=ids, logprobs=[-0.5] * len(ids), text=text,
                                      finish_reason="stop", policy_version=version,
                                      node="n1") for _ in range(r.n)])
        return out


def _run(env, tok, sampler, items, limits, group_size=2):
    prompts = [chat.prompt_ids(tok, it.messages) for it in items]
    return episode.run_episodes(env, items, prompts, sampler, chat.ChatDelta(tok), limits,
                                group_size=group_size, seed=7, decode=tok.decode)


def test_reverse_retry_episode_is_token_exact_with_a_model_only_mask(tok):
    env = reverse.ReverseWordsRetry(seed=0, eval_size=4)
    item = TaskItem("Words: red cat blue", ({"role": "user", "content": "Words: red cat blue"},),
                    {"answer": "blue cat red"})
    sampler = FakeSampler(tok, ["red cat blue", "blue cat red"])
    groups = _run(env, tok, sampler, [item], episode.EpisodeLimits(max_turns=3, max_tokens=8))
    ep = groups[0][0]
    assert ep.done and ep.turns == 2 and not ep.truncated and not ep.dropped
    first = [*_ids(tok, "red cat blue"), tok.eos_token_id]
    second = [*_ids(tok, "blue cat red"), tok.eos_token_id]
    env_ids = ep.token_ids[len(first):len(ep.token_ids) - len(second)]
    assert ep.token_ids == first + env_ids + second
    assert ep.loss_mask == [1] * len(first) + [0] * len(env_ids) + [1] * len(second)
    assert ep.logprobs == [-0.5] * len(first) + [0.0] * len(env_ids) + [-0.5] * len(second)
    assert ep.model_tokens == len(first) + len(second) and ep.env_tokens == len(env_ids) > 0
    assert ep.transcript[1] == {"role": "user", "content": reverse.feedback("red cat blue",
                                                                         "blue cat red")}
    assert reverse.feedback("red cat blue", "blue cat red") == (
        "Not quite (in the wrong place: red, blue). Reply again with the words in reverse "
        "order.")
    assert reverse.feedback("cat dog", "blue cat red") == (
        "Not quite (not in the phrase: dog; in the wrong place: cat; missing: blue, red). "
        "Reply again with the words in reverse order.")
    # turn 1: one request of the group (n = G, the group's seed); turn 2: one per episode,
    # continuing the episode's own ids, each with its own seed, asking the node to keep caches
    t1, t2 = sampler.requests
    assert len(t1) == 1 and t1[0].n == 2 and t1[0].keep_cache
    assert [r.n for r in t2] == [1, 1] and t2[0].seed != t2[1].seed
    assert t1[0].node == "" and [r.node for r in t2] == ["n1", "n1"]  # pinned to its node
    assert list(t2[0].prompt_ids) == ep.prompt_ids + first + env_ids
    sample = ep.sample()
    assert sample.loss_mask == ep.loss_mask and sample.text == "blue cat red"
    rewards = env.attempt_reward([item.prompt], ["blue cat red"], ["blue cat red"], turns=[2])
    assert rewards == [0.75]
    # solved: the exact reversal only (similarity 0.8 here scores 0), a second attempt's x0.75
    assert env.solved_reward([item.prompt] * 3, ["Blue cat, red.", "blue cat red", "blue cat"],
                             ["blue cat red"] * 3, turns=[1, 2, 1]) == [1.0, 0.75, 0.0]
    assert env.eval_metrics({"turns": [1, 2, 2]}, [1.0, 1.0, 0.5]) == {
        "first_attempt_success": 1 / 3, "second_attempt_success": 1 / 3}


class Endless(Environment):
    name = "endless"

    def train_item(self, index):
        return TaskItem("go", ({"role": "user", "content": "go"},), {})

    def eval_items(self):
        return [self.train_item(0)]

    def respond(self, item, transcript, state):
        state["seen"] = state.get("seen", 0) + 1
        return EnvTurn([{"role": "user", "content": "more"}], counts={"pokes": 1})

    def score(self, prompts, completions, **columns):
        return [0.0] * len(completions)


class Raising(Endless):
    def respond(self, item, transcript, state):
        raise RuntimeError("the environment broke")


def test_an_endless_environment_is_cut_at_the_turn_limit(tok):
    env = Endless()
    groups = _run(env, tok, FakeSampler(tok, ["w1"]), [env.train_item(0)],
                  episode.EpisodeLimits(max_turns=3, max_tokens=4))
    for ep in groups[0]:
        assert ep.turns == 3 and ep.truncated == episode.TRUNCATED_TURNS and not ep.done
        assert ep.counts == {"pokes": 3} and ep.state["seen"] == 3
        assert ep.loss_mask[-1] == 1  # the episode ends with the model's turn
    stats = EpisodeStats.of([ep for g in groups for ep in g])
    assert stats.record()["truncated_episodes"] == 2 and stats.turns_mean == 3


def test_the_episode_token_limit_cuts_and_bounds_each_turn(tok):
    env = Endless()
    sampler = FakeSampler(tok, ["w1 w2 w3 w4 w5 w6"])
    groups = _run(env, tok, sampler, [env.train_item(0)],
                  episode.EpisodeLimits(max_turns=10, max_tokens=6, max_episode_tokens=16))
    ep = groups[0][0]
    assert ep.truncated == episode.TRUNCATED_TOKENS and len(ep.token_ids) <= 16
    later = [r for batch in sampler.requests[1:] for r in batch]
    assert all(r.max_tokens <= 16 - (len(r.prompt_ids) - len(ep.prompt_ids)) for r in later)


def test_failures_drop_episodes_and_the_rest_go_on(tok, caplog):
    env = Raising()
    groups = _run(env, tok, FakeSampler(tok, ["w1"]), [env.train_item(0)],
                  episode.EpisodeLimits(max_turns=3, max_tokens=4))
    assert all(ep.dropped == "env_error" and "the environment broke" in ep.error
               for ep in groups[0])
    assert "the environment broke" in caplog.text
    # a node that dies mid-episode: its episodes are dropped and counted
    groups = _run(Endless(), tok, FakeSampler(tok, ["w1"], fail_turn=1),
                  [env.train_item(0)], episode.EpisodeLimits(max_turns=3, max_tokens=4))
    assert [ep.dropped for ep in groups[0]] == ["sampler", "sampler"]
    # a push between turns: never one episode across two policy versions
    groups = _run(Endless(), tok, FakeSampler(tok, ["w1"], version_turn=1),
                  [env.train_item(0)], episode.EpisodeLimits(max_turns=3, max_tokens=4))
    assert [ep.dropped for ep in groups[0]] == ["mixed_version"] * 2
    stats = EpisodeStats.of(groups[0])
    assert stats.record()["dropped_mixed_version"] == 2


def test_every_turn_s_policy_version_reaches_the_step_record(tok):
    """An episode records the version of each model turn; admission puts every turn's
    version in its node's ``versions`` (log.jsonl), so a record shows that no trained
    episode spans two policy versions."""
    from gridrl.trainer.grpo.admission import admit
    from gridrl.trainer.rollouts import Group

    groups = _run(Endless(), tok, FakeSampler(tok, ["w1"]), [Endless().train_item(0)],
                  episode.EpisodeLimits(max_turns=3, max_tokens=4))
    assert all(ep.turn_versions == [3, 3, 3] for ep in groups[0])
    assert groups[0][0].record()["turn_versions"] == [3, 3, 3]
    samples = [ep.sample() for ep in groups[0]]
    admitted = admit([Group(0, groups[0][0].prompt_ids, samples, "n1", 0.0)],
                     lineage={3: 0}, max_staleness=0)
    assert admitted.per_node["n1"].versions == {3} and len(admitted.kept) == 2
    # an episode whose turns had carried two versions would show both
    samples[0].episode.turn_versions[1] = 4
    admitted = admit([Group(0, groups[0][0].prompt_ids, samples, "n1", 0.0)],
                     lineage={3: 0, 4: 1}, max_staleness=0)
    assert admitted.per_node["n1"].versions == {3, 4}


def test_a_one_turn_environment_asks_what_the_single_turn_task_asked(tok):
    """Turn 1 of a group is one request of G samples seeded group_seed(seed, i): the same
    Generate calls (and so the same samples) as before environments."""
    from gridrl.trainer.rollouts import group_seed

    env = ReverseWords(seed=0, eval_size=4)
    items = [env.train_item(i) for i in range(3)]
    sampler = FakeSampler(tok, ["x"])
    groups = _run(env, tok, sampler, items, episode.EpisodeLimits(max_turns=1, max_tokens=5),
                  group_size=4)
    assert len(sampler.requests) == 1
    assert [(r.seed, r.n, r.keep_cache) for r in sampler.requests[0]] == [
        (group_seed(7, i), 4, False) for i in range(3)]
    assert all(ep.done and ep.loss_mask == [1] * len(ep.token_ids) for g in groups for ep in g)


# --------------------------------------------------------------------------- tools

def test_tool_calls_parse_in_each_family_format():
    calls, errors = tools.parse_tool_calls(
        'ok <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert calls == [tools.ToolCall("add", {"a": 1, "b": 2})] and errors == []
    # SmolLM2's format: a list inside one block
    calls, _ = tools.parse_tool_calls('<tool_call>[{"name": "add", "arguments": {"a": 1}}, '
                                      '{"name": "multiply", "arguments": {"a": 2}}]</tool_call>')
    assert [c.name for c in calls] == ["add", "multiply"]
    calls, errors = tools.parse_tool_calls("<tool_call>{name: add}</tool_call>")
    assert calls == [] and "not valid JSON" in errors[0]
    calls, errors = tools.parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert calls == [] and "needs a \"name\"" in errors[0]
    assert tools.parse_tool_calls("the answer is 5") == ([], [])
    calls, _ = tools.parse_tool_calls(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', tools.LLAMA3)
    assert calls == [tools.ToolCall("add", {"a": 1, "b": 2})]
    calls, _ = tools.parse_tool_calls('{"name": "add", "parameters": "{\\"a\\": 3}"}',
                                      tools.LLAMA3)
    assert calls == [tools.ToolCall("add", {"a": 3})]


def hang(seconds: float) -> str:
    """Wait.

    Args:
        seconds: how long.
    """
    threading.Event().wait(seconds)
    return "late"


def broken(x: int) -> int:
    """Raise.

    Args:
        x: anything.
    """
    raise ZeroDivisionError("no")


class Hanging(tools.ToolArithmetic):
    def tools(self):
        return [tools.add, hang, broken]


def test_tool_env_runs_calls_and_turns_every_failure_into_a_message(tok):
    env = Hanging(timeout_s=0.2)
    item = env.train_item(0)
    reply = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
             '<tool_call>{"name": "hang", "arguments": {"seconds": 30}}</tool_call>'
             '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
             '<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>'
             '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
             '<tool_call>not json</tool_call>')
    turn = env.respond(item, [{"role": "assistant", "content": reply}], {})
    assert not turn.done
    contents = [m["content"] for m in turn.messages]
    assert contents[0].startswith("Error: the tool call is not valid JSON")
    assert contents[1] == "5"
    assert "did not answer within 0.2 s" in contents[2]
    assert "no tool named 'nope'" in contents[3]
    assert "add" in contents[4] and "Error" in contents[4]
    # the fifth call is past max_calls=4
    assert "at most 4 tool calls" in contents[5]
    assert turn.counts == {"tool_calls": 6, "tool_errors": 4, "tool_timeouts": 1}
    assert all(m["role"] == "tool" for m in turn.messages)
    final = env.respond(item, [{"role": "assistant", "content": "8"}], {})
    assert final.done and final.counts == {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0}


def test_tools_go_to_the_template_or_to_the_system_prompt(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    env = tools.ToolArithmetic(tok)
    assert env.tools_in_system and env.template_tools() is None  # this template ignores tools
    item = env.train_item(0)
    assert "<tools>" in item.messages[0]["content"] and '"name": "multiply"' in \
        item.messages[0]["content"]
    tok.chat_template = ("{% if tools %}TOOLS {{ tools | tojson }} {% endif %}"
                         "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> "
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    env = tools.ToolArithmetic(tok)
    assert not env.tools_in_system and [s["function"]["name"] for s in env.template_tools()] \
        == ["add", "multiply"]
    assert "<tools>" not in env.train_item(0).messages[0]["content"]
    assert env.score(["q"], ["It is 1,234."], answer=["1234"]) == [1.0]
    assert env.score(["q"], ["12345"], answer=["1234"]) == [0.0]


def test_tool_episode_end_to_end_with_a_scripted_model(tok):
    env = tools.ToolArithmetic(tok, seed=0, eval_size=2)
    item = env.train_item(0)
    a, b = (int(x) for x in re.findall(r"\d+", item.prompt))
    op = "add" if "plus" in item.prompt else "multiply"
    call = json.dumps([{"name": op, "arguments": {"a": a, "b": b}}])
    sampler = FakeSampler(tok, [f"<tool_call>{call}</tool_call>", item.columns["answer"]])
    groups = _run(env, tok, sampler, [item], episode.EpisodeLimits(max_turns=4, max_tokens=64),
                  group_size=1)
    ep = groups[0][0]
    assert ep.done and ep.turns == 2 and ep.counts["tool_calls"] == 1
    assert ep.transcript[1] == {"role": "tool", "name": op, "content": item.columns["answer"]}
    assert env.score([item.prompt], [ep.last_reply], answer=[item.columns["answer"]]) == [1.0]


# --------------------------------------------------------------------------- --task

ENV_FILE = '''
from gridrl.trainer.envs.base import Environment, EnvTurn, TaskItem

class Echo(Environment):
    name = "echo"
    max_turns = 2

    def __init__(self, seed=0):
        self.seed = seed

    def train_item(self, index):
        return TaskItem(f"say {index}", ({"role": "user", "content": f"say {index}"},),
                        {"answer": str(index)})

    def eval_items(self):
        return [self.train_item(-1)]

    def score(self, prompts, completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]
'''


def test_task_specs_load_environments_or_fail_in_one_line(tmp_path, monkeypatch):
    assert isinstance(loading.make_environment("reverse-words", seed=0, eval_size=4),
                      ReverseWords)
    assert loading.make_environment("reverse-words-retry", seed=0, eval_size=4).max_turns == 2
    path = tmp_path / "echo_env.py"
    path.write_text(ENV_FILE)
    env = loading.make_environment(str(path), seed=5, eval_size=4)
    assert env.name == "echo" and env.seed == 5 and env.train_item(3).columns == {"answer": "3"}
    (tmp_path / "two.py").write_text(ENV_FILE + "\nclass Other(Echo):\n    pass\n")
    with pytest.raises(StatusError, match="2 Environment subclasses"):
        loading.make_environment(str(tmp_path / "two.py"), seed=0, eval_size=4)
    with pytest.raises(StatusError, match=r"--task.*none of"):
        loading.make_environment("nonsense", seed=0, eval_size=4)
    # a missing extra names what to install
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(StatusError, match=r"pip install .*reasoning-gym"):
        loading.make_environment("reasoning-gym:spell_backward", seed=0, eval_size=4)


def test_jsonl_rows_may_hold_chat_messages(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": f"q{i}"}], "answer": f"a{i}"}
            for i in range(6)]
    rows.append({"prompt": "plain", "answer": "p"})
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    env = loading.make_environment(str(path), seed=0, eval_size=2)
    items = [env.train_item(i) for i in range(5)]
    chats = [it for it in items if it.prompt.startswith("q")]
    assert chats and all(it.messages[0] == {"role": "system", "content": "be brief"}
                         and it.prompt == it.messages[-1]["content"]
                         and "messages" not in it.columns for it in chats)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": "hi"}) + "\n")
    with pytest.raises(StatusError, match=r"bad\.jsonl:1: 'messages' must be"):
        loading.make_environment(str(bad), seed=0, eval_size=1)


# --------------------------------------------------------------------------- verifiers

VF_PACKAGE = '''
import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=2.0)
    def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def turns(self, trace) -> float:
        return 1.0 / trace.num_turns


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        for i in range(20):
            yield EchoTask(EchoData(prompt=f"say w{i}", system_prompt="echo", answer=f"w{i}"))
'''

VF_ENV = '''

class TwoTriesConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class TwoTries(vf.Env[TwoTriesConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as i:
            seg = await i.turn()
            if seg.last_reply != task.data.answer:
                await i.turn(f"no: say {task.data.answer}")
'''


@pytest.fixture
def vf_packages(tmp_path, monkeypatch):
    """Two tiny verifiers environment packages on sys.path: a plain taskset (single-turn)
    and one that exports an Env of its own (a second try after a wrong answer)."""
    pytest.importorskip("verifiers.v1")
    for name, body, exports in (("gridrl_vf_echo", VF_PACKAGE, '["EchoTaskset"]'),
                                ("gridrl_vf_twice", VF_PACKAGE + VF_ENV,
                                 '["EchoTaskset", "TwoTries"]')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"{body}\n__all__ = {exports}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_verifiers_taskset_is_a_single_turn_environment(vf_packages, tok):
    from gridrl.trainer.rewards import RewardSet

    env = loading.make_environment("verifiers:gridrl-vf-echo", seed=0, eval_size=4)
    assert env.max_turns == 1 and len(env.eval_items()) == 4
    held = {it.prompt for it in env.eval_items()}
    assert not held & {env.train_item(i).prompt for i in range(16)}
    item = env.train_item(0)
    assert item.messages == ({"role": "system", "content": "echo"},
                             {"role": "user", "content": item.prompt})
    answer = item.columns["vf_task"].data.answer
    groups = _run(env, tok, FakeSampler(tok, [answer]), [item],
                  episode.EpisodeLimits(max_turns=4, max_tokens=8))
    ep = groups[0][0]
    assert ep.done and ep.turns == 1
    funcs = env.reward_funcs()
    assert [(n, w) for n, _, w in funcs] == [("verifiers:exact", 2.0), ("verifiers:turns", 0.5)]
    rewards = RewardSet([(n, f) for n, f, _ in funcs], [w for _, _, w in funcs])
    total, per = rewards([item.prompt, item.prompt], [answer, "w999"],
                         {"vf_task": [item.columns["vf_task"]] * 2})  # single-turn columns
    assert per == {"verifiers:exact": [1.0, 0.0], "verifiers:turns": [1.0, 1.0]}
    assert total == [2.5, 0.5]
    assert env.score([item.prompt], [answer], **episode.reward_columns(groups[0][:1])) == [1.0]


def test_a_verifiers_env_runs_its_turns_through_gridrl(vf_packages, tok):
    env = loading.make_environment("verifiers:gridrl-vf-twice", seed=0, eval_size=4)
    assert env.max_turns > 1
    item = env.train_item(0)
    answer = item.columns["vf_task"].data.answer
    groups = _run(env, tok, FakeSampler(tok, ["wrong", answer]), [item],
                  episode.EpisodeLimits(max_turns=4, max_tokens=8))
    ep = groups[0][0]
    assert ep.done and ep.turns == 2 and ep.env_tokens > 0
    assert ep.transcript[1] == {"role": "user", "content": f"no: say {answer}"}
    scores = env.reward_funcs()
    columns = episode.reward_columns([ep])
    assert scores[0][1]([item.prompt], [ep.last_reply], **columns) == [1.0]
    assert scores[1][1]([item.prompt], [ep.last_reply], **columns) == [0.5]  # two turns


def test_verifiers_failures_name_the_fix(vf_packages, monkeypatch):
    with pytest.raises(StatusError, match="no verifiers taskset 'nope-nothing'"):
        loading.make_environment("verifiers:nope-nothing", seed=0, eval_size=4)
    with pytest.raises(StatusError, match="20 tasks, need more than --eval-tasks=20"):
        loading.make_environment("verifiers:gridrl-vf-echo", seed=0, eval_size=20)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(StatusError, match=r"verifiers is not installed: pip install"):
        loading.make_environment("verifiers:gridrl-vf-echo", seed=0, eval_size=4)


def test_reasoning_gym_dataset_items_scores_and_split():
    pytest.importorskip("reasoning_gym")
    env = loading.make_environment("reasoning-gym:spell_backward", seed=3, eval_size=8,
                                   task_params="min_word_len=3,max_word_len=5")
    held = {it.prompt for it in env.eval_items()}
    assert len(held) == 8 and not held & {env.train_item(i).prompt for i in range(300)}
    item = env.train_item(0)
    assert item == loading.make_environment("reasoning-gym:spell_backward", seed=3,
                                            eval_size=8,
                                            task_params="min_word_len=3,max_word_len=5"
                                            ).train_item(0)
    word = item.columns["entry"]["metadata"]["word"]
    assert 3 <= len(word) <= 5
    columns = {"entry": [item.columns["entry"]] * 3}
    assert env.score([item.prompt] * 3, [f"<answer>{word[::-1]}</answer>", word[::-1], "zzz"],
                     **columns)[:2] == [1.0, 1.0]
    from gridrl.trainer.envs.reasoning_gym import plain_answer

    assert [plain_answer(r) for r in ('The answer is: "nus".', "tac", "Sure.\n\n-12",
                                      "Result: 'abc'", "1 - 1 = 0.", "6 - 7 = -1")] == [
        "nus", "tac", "-12", "abc", "0", "-1"]
    with pytest.raises(StatusError, match="has no dataset 'nope'"):
        loading.make_environment("reasoning-gym:nope", seed=0, eval_size=4)
    with pytest.raises(StatusError, match="--task-params"):
        loading.make_environment("reasoning-gym:spell_backward", seed=0, eval_size=4,
                                 task_params="bogus_field=1")


def test_task_params_read_booleans_numbers_none_and_lists():
    from gridrl.trainer.envs.reasoning_gym import parse_params

    assert parse_params("allow_negation=False,a=true,b=no,c=YES,d=None,e=null,f=3,g=-2,"
                        "h=0.5,i=1e-3,j=abc") == {
        "allow_negation": False, "a": True, "b": False, "c": True, "d": None, "e": None,
        "f": 3, "g": -2, "h": 0.5, "i": 0.001, "j": "abc"}
    # lists: commas inside brackets do not split pairs; JSON values keep working
    assert parse_params("operators=[+,-],max_terms=2,ws=[ 1 , 2.5 , x ],none=[]") == {
        "operators": ["+", "-"], "max_terms": 2, "ws": [1, 2.5, "x"], "none": []}
    assert parse_params('ops=["*", "/"],cfg={"k": [1, 2]},s="False",q=\'7\'') == {
        "ops": ["*", "/"], "cfg": {"k": [1, 2]}, "s": "False", "q": "7"}
    assert parse_params("") == {} and parse_params(" a = 1 , ") == {"a": 1}
    for bad, message in (("a=1,a=2", "'a' is given twice"), ("ops=[+,-", "a list ends with"),
                          ("flag", "'flag' is not key=value")):
        with pytest.raises(StatusError, match=re.escape(message)):
            parse_params(bad)


def test_task_params_reach_the_dataset_typed_and_unknown_keys_name_the_valid_ones():
    pytest.importorskip("reasoning_gym")
    env = loading.make_environment(
        "reasoning-gym:basic_arithmetic", seed=0, eval_size=4,
        task_params="allow_negation=False,operators=[+,-],min_terms=2,max_terms=2")
    config = env.train.config
    assert config.allow_negation is False and list(config.operators) == ["+", "-"]
    assert config.min_terms == config.max_terms == 2
    for item in [env.train_item(i) for i in range(20)] + env.eval_items():
        assert "*" not in item.prompt and "/" not in item.prompt
    with pytest.raises(StatusError) as caught:
        loading.make_environment("reasoning-gym:chain_sum", seed=0, eval_size=4,
                                 task_params="allow_negatives=false")
    assert str(caught.value) == (
        "INVALID_ARGUMENT: --task-params: chain_sum has no parameter 'allow_negatives'; its "
        "parameters: min_terms, max_terms, min_digits, max_digits, allow_negation")
    with pytest.raises(StatusError, match="seed: set by gridrl"):
        loading.make_environment("reasoning-gym:chain_sum", seed=0, eval_size=4,
                                 task_params="seed=3")


def test_an_environment_file_that_fails_to_import_is_named_with_its_line(tmp_path):
    bad = tmp_path / "env.py"
    bad.write_text("from gridrl.trainer.envs.base import Environment\n\nclass Env(:\n    pass\n")
    with pytest.raises(StatusError) as caught:
        loading.make_environment(str(bad), seed=0, eval_size=4)
    assert str(caught.value) == (f"INVALID_ARGUMENT: --task: {bad}:3:11: import failed: "
                                 "SyntaxError: invalid syntax: 'class Env(:'")
    bad.write_text("import os\n\nLIMIT = 3\nWORDS = LIMT * 2\n")
    with pytest.raises(StatusError) as caught:
        loading.make_environment(str(bad), seed=0, eval_size=4)
    assert str(caught.value) == (f"INVALID_ARGUMENT: --task: {bad}:4: import failed: "
                                 "NameError: name 'LIMT' is not defined")


def test_the_run_s_rewards_are_the_environment_s_unless_reward_files_say_otherwise(tmp_path):
    from gridrl.trainer.rewards import build_reward_set

    env = loading.make_environment("reverse-words-retry", seed=0, eval_size=4)
    rewards = build_reward_set(env, [], None)
    assert rewards.names == ["reverse-words-retry:attempt", "reverse-words-retry:solved"]
    assert rewards.weights == [0.5, 0.5]
    assert build_reward_set(env, [], "0.25,1").weights == [0.25, 1.0]
    single = loading.make_environment("reverse-words", seed=0, eval_size=4)
    assert build_reward_set(single, [], None).names == ["reverse-words:score"]
    path = tmp_path / "r.py"
    path.write_text("def short(prompts, completions, **kw):\n"
                    "    return [float(len(c) < 5) for c in completions]\n")
    assert build_reward_set(env, [str(path)], None).names == ["short"]


def test_the_flags_defaults_follow_the_environment():
    from gridrl.trainer.config import TrainConfig

    def finalized(task):
        return TrainConfig(task=task, run_dir="unused").finalize()

    assert (finalized("reverse-words").max_tokens, finalized("reverse-words").eval_tasks) == \
        (24, 128)
    assert finalized("reverse-words-retry").max_tokens == 24
    assert finalized("tool-arithmetic").max_tokens == 48
    assert finalized("reasoning-gym:spell_backward").eval_tasks == 64
    assert finalized("verifiers:anything").max_tokens == 64
    cfg = finalized("reverse-words")
    assert cfg.max_turns is None and cfg.max_episode_tokens == 0 and cfg.task_params == ""
