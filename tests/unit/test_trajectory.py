import pytest

from services.scheduler.agent import observation, parse_action
from services.scheduler.environment import Step
from services.scheduler.task import Task, arithmetic_tasks, expression_tasks, extract_answer, score
from services.scheduler.trajectory import (
    CallTool,
    Finish,
    Generate,
    IllegalTransition,
    Reply,
    State,
    Trajectory,
    check_turn,
)

TASK = Task("p0", "What is 2+3?", 5)


def make(max_turns: int = 3, max_ctx: int = 100) -> Trajectory:
    return Trajectory("t0", "g0", 0, 2, TASK, [1, 2, 3], max_turns, 8, max_ctx, started_at=0.0)


def test_tool_loop_then_answer() -> None:
    t = make()
    first = t.first_action()
    assert isinstance(first, Generate) and first.context == [1, 2, 3] and first.max_new_tokens == 8
    act = t.on_turn([10, 11], [-0.1, -0.2], "<calc>2+3</calc>", versions=[0, 0], eos=False)
    assert isinstance(act, CallTool) and act.request.tool == "calculator"
    assert act.request.args == {"expression": "2+3"}
    assert t.state is State.TOOL_PENDING
    nxt = t.on_tool_return("ok", [20, 21, 22])
    assert isinstance(nxt, Generate) and nxt.context == [1, 2, 3, 10, 11, 20, 21, 22]
    fin = t.on_turn([12], [-0.3], "<answer>5</answer>", versions=[1], eos=True)
    assert isinstance(fin, Finish) and fin.reason == "answer"
    assert fin.reward == pytest.approx(1.1)  # correct + tool shaping
    assert t.versions == [0, 1]
    assert [s.generated for s in t.segments] == [False, True, False, True]


def test_max_turns_ends_even_with_tool_call() -> None:
    t = make(max_turns=1)
    t.first_action()
    fin = t.on_turn([10], [-0.1], "<calc>1+1</calc>", versions=[0], eos=False)
    assert isinstance(fin, Finish) and fin.reason == "max_turns" and fin.reward == 0.0


def test_context_budget_ends_with_length() -> None:
    t = make(max_ctx=6)
    t.first_action()
    assert isinstance(t.on_turn([10, 11], [-1.0, -1.0], "<calc>1</calc>", [0, 0], False), CallTool)
    assert isinstance(t.on_tool_return("ok", [5, 5]), Finish)
    assert t.finish is not None and t.finish.reason == "length"


def test_illegal_transitions_are_refused() -> None:
    t = make()
    t.first_action()
    with pytest.raises(IllegalTransition):
        t.on_tool_return("ok", [1])
    with pytest.raises(ValueError):
        t.on_turn([1, 2], [-0.1], "x", [0, 0], False)


def test_parse_action_kinds() -> None:
    assert parse_action("I think <answer>3</answer> <calc>1</calc>") is None
    py = parse_action("Let me compute.\n```python\nprint(2*3)\n```")
    assert py is not None and py.tool == "python" and py.args["code"] == "print(2*3)"
    assert parse_action("just words") is None
    assert parse_action("<calc>   </calc>") is None


def test_scoring_and_answers() -> None:
    assert extract_answer("so <answer>1,024</answer>") == 1024
    assert extract_answer("it is 7 then 9") == 9
    assert extract_answer("no number") is None
    assert score("<answer>5</answer>", 5, tool_ok=0) == 1.0
    assert score("<answer>6</answer>", 5, tool_ok=2) == pytest.approx(0.1)
    assert score("<answer>6</answer>", 5, tool_ok=2, tool_bonus=0.0) == 0.0
    assert score("<answer>5</answer>", 5, tool_ok=1, tool_bonus=0.0) == 1.0


def test_tool_bonus_reaches_the_reward() -> None:
    t = Trajectory("t0", "g0", 0, 2, TASK, [1, 2, 3], 3, 8, 100, started_at=0.0, tool_bonus=0.0)
    t.first_action()
    call = t.on_turn([5, 6], [-0.1, -0.2], "<calc>2+3</calc>", [0, 0], eos=False)
    assert isinstance(call, CallTool)
    t.on_tool_return("ok", [7])
    fin = t.on_turn([8], [-0.3], "<answer>4</answer>", [0], eos=True)
    assert isinstance(fin, Finish) and fin.reward == 0.0


def test_observation_text() -> None:
    assert observation("ok", '{"stdout": "42\\n", "stderr": "", "exit_code": 0}') == "Result: 42"
    assert observation("timeout", "took too long").startswith("Tool timeout:")


def test_tasks_are_reproducible_and_correct() -> None:
    a, b = arithmetic_tasks(20, 3), arithmetic_tasks(20, 3)
    assert a == b
    assert len({t.prompt_id for t in a}) == 20
    assert all(t.answer >= 0 for t in a)


def test_expression_tasks_say_their_expression_in_words() -> None:
    tasks = expression_tasks(200, 1)
    assert tasks == expression_tasks(200, 1) and len({t.prompt_id for t in tasks}) == 200
    for t in tasks:
        words = t.question.rstrip("?.").split()
        nums = [int(w) for w in words if w.isdigit()]
        assert len(nums) == 3 and t.answer > 0
        c, a, b = nums if words[3] == "plus" else nums[2:] + nums[:2]  # "What is C plus A times B?"
        expected = a * b - c if ("minus" in words or "subtract" in words) else a * b + c
        assert t.answer == expected, t


def test_a_turn_across_a_weight_swap_becomes_one_segment_per_version() -> None:
    t = make()
    t.first_action()
    fin = t.on_turn([5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], "<answer>5</answer>", [3, 3, 4, 4], eos=True)
    assert isinstance(fin, Finish)
    generated = [s for s in t.segments if s.generated]
    assert [(s.token_ids, s.logprobs, s.policy_version) for s in generated] == [
        ([5, 6], [-0.1, -0.2], 3),
        ([7, 8], [-0.3, -0.4], 4),
    ]
    assert t.versions == [3, 4]


@pytest.mark.parametrize("versions", [[1], [2, 1], [-1, 0]])
def test_a_turn_with_missing_or_backward_versions_is_refused(versions: list[int]) -> None:
    t = make()
    t.first_action()
    with pytest.raises(ValueError):
        t.on_turn([5, 6], [-0.1, -0.2], "x", versions, eos=False)
    assert t.turns == 0 and len(t.segments) == 1


def test_groups_with_a_member_older_than_the_staleness_bound_are_doomed() -> None:
    from services.policy.staleness import StalenessBound
    from services.scheduler.trajectory import doomed_groups

    def traj(group: str, versions: list[int]) -> Trajectory:
        t = Trajectory(f"{group}-{len(versions)}", group, 0, 2, TASK, [1, 2, 3], 3, 8, 100, 0.0)
        t.first_action()
        if versions:
            t.on_turn([5] * len(versions), [-0.1] * len(versions), "<calc>1</calc>", versions, eos=False)
        return t

    trajs = [traj("old", [1, 2]), traj("old", []), traj("fresh", [3]), traj("new", []), traj("edge", [2])]
    assert doomed_groups(trajs, trained_version=3, bound=StalenessBound(1)) == {"old"}
    assert doomed_groups(trajs, trained_version=4, bound=StalenessBound(1)) == {"old", "edge"}
    assert doomed_groups(trajs, trained_version=4, bound=StalenessBound(3)) == set()


def test_no_turn_may_run_on_weights_older_than_its_group_launch_or_its_own_tokens() -> None:
    """A group launched for version 3 (the trainer's version then) must not start on an engine
    still serving version 2: it would be stale a step early and thrown away."""
    t = Trajectory("t0", "g0", 0, 2, TASK, [1, 2, 3], 3, 8, 100, 0.0, launch_version=3)
    assert t.min_policy_version == 3
    t.first_action()
    t.on_turn([5, 6], [-0.1, -0.2], "<calc>1</calc>", [3, 5], eos=False)
    assert t.min_policy_version == 5
    assert make().min_policy_version == 0


def test_generated_segments_carry_the_temperature_of_their_logprobs() -> None:
    t = make()
    t.first_action()
    t.on_turn([10, 11], [-0.1, -0.2], "<calc>1</calc>", [0, 1], eos=False, temperature=0.6)
    assert [(s.policy_version, s.temperature) for s in t.segments if s.generated] == [(0, 0.6), (1, 0.6)]
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            check_turn([1], [-0.1], [0], bad)


def test_a_turn_result_no_engine_could_make_is_refused() -> None:
    check_turn([0, 99], [-0.1, 0.0], [1, 1], vocab_size=100, max_tokens=2)  # at the limits: fine
    cases = [
        (([1], [float("nan")], [0]), {}, "log-probability"),
        (([1], [float("-inf")], [0]), {}, "log-probability"),
        (([1], [0.5], [0]), {}, "log-probability"),
        (([100], [-0.1], [0]), {"vocab_size": 100}, "vocabulary"),
        (([-1], [-0.1], [0]), {}, "vocabulary"),
        (([1, 2, 3], [-0.1] * 3, [0] * 3), {"max_tokens": 2}, "at most 2"),
        (([1, 2], [-0.1] * 2, [2, 1]), {}, "go back"),
    ]
    for (ids, lps, versions), kw, why in cases:
        with pytest.raises(ValueError, match=why):
            check_turn(ids, lps, versions, **kw)


def test_tool_calls_in_the_hermes_format() -> None:
    call = parse_action(
        'Let me see. <tool_call>{"name": "convert", "arguments": {"value": 2, "from": "h", "to": "s"}}'
    )
    assert call is not None and (call.tool, call.args) == ("convert", {"value": 2, "from": "h", "to": "s"})
    as_string = parse_action('<tool_call>{"name": "convert", "arguments": "{\\"value\\": 1}"}</tool_call>')
    assert as_string is not None and as_string.args == {"value": 1}
    broken = parse_action("<tool_call>{name: convert}</tool_call>")
    assert broken is not None and broken.tool == "" and "not valid JSON" in broken.args["error"]
    nameless = parse_action('<tool_call>{"arguments": {}}</tool_call>')
    assert nameless is not None and nameless.tool == ""
    assert parse_action('<answer>7</answer> <tool_call>{"name": "x"}</tool_call>') is None


def test_a_trajectory_is_truncated_when_its_last_turn_was_cut_or_its_context_ran_out() -> None:
    t = make(max_turns=1)
    t.first_action()
    t.on_turn([10] * 8, [-0.1] * 8, "The answer is 1", versions=[0] * 8, eos=False, cut=True)
    assert t.truncated and t.finish is not None  # the text is its answer, cut short
    done = make(max_turns=1)
    done.first_action()
    done.on_turn([10], [-0.1], "<answer>5</answer>", versions=[0], eos=True)
    assert not done.truncated
    # a turn cut mid-way, then an answer that fits: the last turn decides
    t = make()
    t.first_action()
    t.on_turn([10] * 8, [-0.1] * 8, "<calc>2+3</calc>", versions=[0] * 8, eos=False, cut=True)
    t.on_tool_return("ok", [20])
    t.on_turn([12], [-0.3], "<answer>5</answer>", versions=[0], eos=True)
    assert not t.truncated
    # the context ran out
    t = make(max_ctx=6)
    t.first_action()
    t.on_turn([10, 11], [-1.0, -1.0], "<calc>1</calc>", [0, 0], False)
    t.on_tool_return("ok", [5, 5])
    assert t.truncated


def test_a_built_in_prompt_shows_worked_examples_unless_the_task_turns_them_off(tiny_model) -> None:
    from services.common.models import load_tokenizer
    from services.scheduler.prompting import Prompter
    from services.scheduler.task import SYSTEM_PROMPT

    tok = load_tokenizer(tiny_model)
    task = expression_tasks(1, 0)[0]
    shown = tok.decode(Prompter(tok, "expressions").prompt_ids(task))
    bare = tok.decode(Prompter(tok, "expressions", worked_examples=0).prompt_ids(task))
    one = tok.decode(Prompter(tok, "expressions", worked_examples=1).prompt_ids(task))
    assert "<calc>12*7+5</calc>" in shown and "<calc>15*6-4</calc>" in shown
    assert "<calc>12*7+5</calc>" in one and "<calc>15*6-4</calc>" not in one
    assert "<calc>" not in bare.replace(SYSTEM_PROMPT, "")
    assert SYSTEM_PROMPT in bare and task.question in bare


def test_a_rewritten_conversation_replaces_the_context_and_keeps_what_was_sampled() -> None:
    """An agent's call that rewrote its conversation: the model sees the rewrite from then on (its
    budget measured against it), and every token sampled before stays in the trajectory."""
    t = make(max_turns=4, max_ctx=12)
    t.first_action()
    act = t.on_turn([10, 11], [-0.1, -0.2], "hi", versions=[0, 0], eos=True, step=Step(observation="more"))
    assert isinstance(act, Reply)
    nxt = t.on_reply([7, 8], rewritten=True)
    assert isinstance(nxt, Generate) and nxt.context == [7, 8] and nxt.max_new_tokens == 8
    assert (t.context_tokens, t.sequences, t.output_tokens) == (2, 2, 2)
    act = t.on_turn([12, 13], [-0.3, -0.4], "ok", versions=[1, 1], eos=True, step=Step(observation="on"))
    nxt = t.on_reply([9])
    assert isinstance(nxt, Generate) and nxt.context == [7, 8, 12, 13, 9] and nxt.max_new_tokens == 7
    assert [(s.token_ids, s.starts_sequence) for s in t.segments] == [
        ([1, 2, 3], False),
        ([10, 11], False),
        ([7, 8], True),
        ([12, 13], False),
        ([9], False),
    ]
    assert t.versions == [0, 1] and t.output_tokens == 4
