"""Speculative decoding's pure parts: the drafter that reads siblings and earlier rollouts, and the
lossless verification rule (`sampling.verify_draft`)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from services.common.runconfig import SpeculativeConfig
from services.generation.drafter import Draft, SuffixDrafter
from services.generation.sampling import (
    gumbel_noise,
    noise_key,
    sample_next,
    verify_draft,
    verify_drafts,
)
from services.generation.speculator import Row, Speculator


def test_a_sibling_continues_the_longest_match_and_beats_another_groups_rollout() -> None:
    d = SuffixDrafter(key_len=2, max_match=8)
    d.add("p1", "g-old", [1, 2, 3, 4, 50, 51, 52])
    d.add("p1", "g1", [9, 3, 4, 60, 61, 62])
    # both responses contain "3 4"; the match is 2 long in each: the sibling (g1) wins the tie
    assert d.draft("p1", "g1", [7, 3, 4], 3).tokens == [60, 61, 62]
    # a longer match wins over the sibling: "2 3 4" occurs only in the old rollout
    got = d.draft("p1", "g1", [2, 3, 4], 2)
    assert (got.tokens, got.match, got.source) == ([50, 51], 3, "prompt")
    # another prompt's responses are never read; then the context itself is (prompt lookup)
    own = d.draft("p2", "g1", [5, 6, 7, 8, 5, 6], 2)
    assert (own.tokens, own.source) == ([7, 8], "self")
    assert d.draft("p2", "g1", [5, 6, 7], 2).tokens == []
    assert d.draft("p1", "g1", [3, 4], 0).tokens == []


def test_the_drafter_stays_bounded_and_forgets_the_oldest() -> None:
    d = SuffixDrafter(key_len=2, max_sequences=2, max_prompts=2, min_key=2)
    d.add("p", "g", [1, 2, 3, 10])
    d.add("p", "g", [4, 5, 6, 11])
    d.add("p", "g", [7, 8, 9, 12])  # the first response is dropped
    assert d.draft("p", "g", [2, 3], 1).tokens == []
    assert d.draft("p", "g", [8, 9], 1).tokens == [12]
    for i in range(50):  # the index holds only the kept responses' keys
        d.add("p", "g", [100 + i, 200 + i, 300 + i, 400 + i])
    assert len(d._prompts["p"].index) == 2 * 2  # two responses of two keys each
    d.add("q", "g", [1, 1, 1, 1])
    d.add("r", "g", [2, 2, 2, 2])  # three prompts: the least recently added ("p") goes
    assert len(d) == 2 and d.draft("p", "g", [8, 9], 1).tokens == []


def test_the_drafter_backs_off_to_shorter_keys_only_where_no_full_key_matches() -> None:
    d = SuffixDrafter(key_len=3, max_match=8)
    d.add("p", "g", [1, 2, 3, 40, 41, 9, 3, 50, 51])
    # "1 2 3" occurs: the full key wins over the later one-token match of "3"
    assert d.draft("p", "g", [1, 2, 3], 2) == Draft([40, 41], 3, "group")
    # "7 8 3" does not, nor "8 3": the latest "3" continues it, a match of one token
    assert d.draft("p", "g", [7, 8, 3], 2) == Draft([50, 51], 1, "group")
    assert SuffixDrafter(key_len=3, min_key=3).draft("p", "g", [7, 8, 3], 2).tokens == []
    with pytest.raises(ValueError, match="min_key"):
        SuffixDrafter(key_len=2, min_key=3)


def test_the_continuation_most_responses_agree_on_is_drafted_token_by_token() -> None:
    d = SuffixDrafter(key_len=2, max_match=8)
    d.add("p", "a", [5, 6, 10, 11, 12])
    d.add("p", "b", [5, 6, 10, 11, 13])
    d.add("p", "c", [5, 6, 20, 21, 22])  # the most recent disagrees from the first token
    # two of three continue "5 6" with "10 11", then split one to one: the more recent (13) wins
    assert d.draft("p", "x", [1, 5, 6], 3) == Draft([10, 11, 13], 2, "prompt")
    # a longer match weighs more: "4 5 6" is matched 3 long by c's response only
    d.add("p", "c", [4, 5, 6, 20, 21, 22])
    assert d.draft("p", "x", [4, 5, 6], 2).tokens == [20, 21]
    # the votes counted for the first token come with a sibling: the draft is the group's
    assert d.draft("p", "a", [1, 5, 6], 1).source == "group"


def test_backed_off_drafts_are_priced_by_their_own_acceptance() -> None:
    spec = Speculator(SpeculativeConfig(method="suffix", num_tokens=2, policy="fixed"))
    spec.drafter.add("p", "g", [1, 2, 3, 40, 41, 9, 3, 50, 51])
    rows = [Row(0, "p", "g", [1, 2, 3], 8), Row(1, "p", "g", [7, 8, 3], 8)]
    assert spec.drafts(rows) == {0: [40, 41], 1: [50, 51]}
    spec.verified(0, 2, 3)  # both accepted
    spec.verified(1, 2, 1)  # the backed-off draft rejected
    assert spec.acceptance["group"].rate > spec.acceptance["group-short"].rate
    assert spec.counters.by_source["group"] == [4, 2]  # counted under their source either way


def test_greedy_verification_keeps_drafted_tokens_while_they_are_the_argmax() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.0]])
    assert verify_draft(logits, [1, 0, 2], 0.0)[0] == [1, 0, 2, 1]  # all accepted, plus one
    tokens, logps = verify_draft(logits, [1, 2, 2], 0.0)
    assert tokens == [1, 0]  # the second drafted token is not the argmax: the argmax replaces it
    expected = torch.log_softmax(logits, -1)
    assert logps == pytest.approx([float(expected[0, 1]), float(expected[1, 0])])


def test_an_accepted_or_resampled_token_is_distributed_as_the_target() -> None:
    """Hand-computed: p = (0.5, 0.3, 0.2), draft x = 1. Accepted with probability 0.3; on
    rejection 0 or 2 in proportion 0.5 : 0.2. So the first emitted token is distributed as p."""
    p = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.stack([p.log(), p.log()])  # the second row is only used after an acceptance
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    first = Counter(verify_draft(logits, [1], 1.0, generator=gen)[0][0] for _ in range(n))
    chi2 = sum((first[t] - n * float(p[t])) ** 2 / (n * float(p[t])) for t in range(3))
    assert chi2 < 13.8  # chi-square, 2 degrees of freedom, p = 0.001
    tokens, logps = verify_draft(logits, [1], 1.0, generator=torch.Generator().manual_seed(1))
    assert logps[0] == pytest.approx(math.log(float(p[tokens[0]])), abs=1e-6)


def test_verification_matches_plain_sampling_at_a_temperature_and_top_p() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 6) * 2
    probs = torch.softmax(logits[0] / 0.7, dim=-1)
    order = probs.argsort(descending=True).tolist()
    nucleus = [t for i, t in enumerate(order) if float(probs[order[:i]].sum()) < 0.8]
    target = torch.zeros(6)
    target[nucleus] = probs[nucleus] / probs[nucleus].sum()
    plain, _ = sample_next(logits.repeat(4, 1), torch.full((4,), 0.7), top_p=torch.full((4,), 0.8))
    assert all(float(target[t]) > 0 for t in plain)  # the target is the distribution sampled from
    gen = torch.Generator().manual_seed(2)
    n = 20_000
    draft = int(target.argmin())  # drafting a token outside the nucleus: never accepted
    seen = Counter(verify_draft(torch.cat([logits, logits]), [draft], 0.7, 0.8, gen)[0][0] for _ in range(n))
    support = [t for t in range(6) if float(target[t]) > 0]
    assert set(seen) <= set(support)
    chi2 = sum((seen[t] - n * float(target[t])) ** 2 / (n * float(target[t])) for t in support)
    assert chi2 < 20.5  # chi-square, up to 5 degrees of freedom, p = 0.001


def test_rows_verified_together_follow_the_rule_each_as_alone() -> None:
    """Greedy: the same tokens and logprobs as row by row. Sampling: each row of a batch of rows
    with different draft lengths emits its first token distributed as its own target."""
    torch.manual_seed(3)
    logits = [torch.randn(k + 1, 5) * 2 for k in (2, 0, 3)]
    drafts = [[int(x.argmax()) for x in lg[:-1]] for lg in logits]
    drafts[2][1] = (drafts[2][1] + 1) % 5  # the third row's second drafted token is not the argmax
    packed = torch.cat(logits)
    together = verify_drafts(packed, drafts, [0.0] * 3, [1.0] * 3)
    alone = [verify_draft(lg, d, 0.0) for lg, d in zip(logits, drafts, strict=True)]
    assert [t for t, _ in together] == [t for t, _ in alone]
    for (_, a), (_, b) in zip(together, alone, strict=True):
        assert a == pytest.approx(b)
    assert [len(t) for t, _ in together] == [3, 1, 2]
    p = [torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.1, 0.6, 0.3])]
    rows = torch.cat([p[0].log().repeat(3, 1), p[1].log().repeat(2, 1)])  # drafts of 2 and 1 tokens
    gen = torch.Generator().manual_seed(4)
    n = 8_000
    seen: list[Counter[int]] = [Counter(), Counter()]
    for _ in range(n):
        for i, (tokens, _) in enumerate(verify_drafts(rows, [[1, 1], [2]], [1.0, 1.0], [1.0, 1.0], gen)):
            seen[i][tokens[0]] += 1
    for counts, target in zip(seen, p, strict=True):
        chi2 = sum((counts[t] - n * float(target[t])) ** 2 / (n * float(target[t])) for t in range(3))
        assert chi2 < 13.8  # chi-square, 2 degrees of freedom, p = 0.001


def test_seeded_noise_depends_only_on_its_key_and_samples_the_target() -> None:
    keys = [noise_key(7, pos) for pos in range(20_000)]
    assert keys[:5] == [noise_key(7, pos) for pos in range(5)] and len(set(keys)) == len(keys)
    assert all(0 <= k < 2**32 for k in keys) and noise_key(8, 0) != noise_key(7, 0)
    noise = gumbel_noise(torch.tensor(keys[:3]), 6)
    assert torch.equal(noise, gumbel_noise(torch.tensor(keys[:3]), 6))
    assert not torch.equal(noise[0], noise[1])
    # argmax of logp + noise over 20,000 keys is distributed as p (chi-square, 2 df, p = 0.001)
    p = torch.tensor([0.5, 0.3, 0.2])
    n = len(keys)
    tokens, logps = sample_next(p.log().repeat(n, 1), torch.ones(n), keys=keys)
    counts = Counter(tokens.tolist())
    assert sum((counts[t] - n * float(p[t])) ** 2 / (n * float(p[t])) for t in range(3)) < 13.8
    assert logps[:3].tolist() == pytest.approx([math.log(float(p[t])) for t in tokens[:3].tolist()])
    # a token of probability zero never; a wrong number of keys refused
    zero = torch.tensor([0.5, 0.0, 0.5]).log().repeat(1000, 1)
    assert 1 not in sample_next(zero, torch.ones(1000), keys=keys[:1000])[0].tolist()
    with pytest.raises(ValueError, match="noise keys"):
        sample_next(p.log().unsqueeze(0), torch.ones(1), keys=[1, 2])


def test_a_seeded_row_samples_the_same_token_beside_greedy_rows_as_alone() -> None:
    """Greedy rows draw no noise and take the argmax; a sampled row's token depends on its own
    logits, temperature, top_p and key only, whatever rows share its batch."""
    torch.manual_seed(6)
    logits = torch.randn(5, 40) * 3
    keys = [noise_key(11, pos) for pos in range(5)]
    temps, tops = [0.0, 1.0, 0.0, 0.7, 1.3], [1.0, 1.0, 0.5, 0.9, 1.0]
    tokens, logps = sample_next(logits, temps, top_p=tops, keys=keys)
    for i in range(5):
        alone, alone_lp = sample_next(logits[i : i + 1], [temps[i]], top_p=[tops[i]], keys=[keys[i]])
        assert int(tokens[i]) == int(alone[0]) and float(logps[i]) == pytest.approx(float(alone_lp[0]))
    assert int(tokens[0]) == int(logits[0].argmax()) and int(tokens[2]) == int(logits[2].argmax())
    # a greedy row reports log_softmax of its logits, whatever its top_p
    assert float(logps[2]) == pytest.approx(float(torch.log_softmax(logits[2], -1).max()))
    with pytest.raises(ValueError, match="temperatures and top_ps"):
        sample_next(logits, temps[:4], keys=keys)


def test_verification_with_the_positions_noise_emits_what_plain_sampling_does() -> None:
    torch.manual_seed(5)
    logits = torch.randn(4, 50)
    keys = [noise_key(3, pos) for pos in range(4)]
    plain = [int(sample_next(logits[j : j + 1], torch.ones(1), keys=[keys[j]])[0]) for j in range(4)]
    # a draft that agrees on two tokens, then not: the two, then plain sampling's third
    wrong = (plain[2] + 1) % 50
    tokens, _ = verify_draft(logits, [plain[0], plain[1], wrong], 1.0, keys=keys)
    assert tokens == plain[:3]
    assert verify_draft(logits, plain[:3], 1.0, keys=keys)[0] == plain  # all kept, and one more
    with pytest.raises(ValueError, match="one noise key per verified position"):
        verify_draft(logits, plain[:3], 1.0, keys=keys[:3])


def test_bad_drafts_are_refused_before_anything_is_sampled() -> None:
    with pytest.raises(ValueError, match="rows of logits"):
        verify_draft(torch.zeros(2, 4), [1, 2], 1.0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_draft(torch.zeros(2, 4), [7], 1.0)
    with pytest.raises(ValueError, match="temperatures"):
        verify_drafts(torch.zeros(2, 4), [[1]], [1.0, 1.0], [1.0])
