"""Drafts for speculative decoding from what this engine already generated for the same prompt.

GRPO samples every prompt several times, and an agent's turns repeat their structure (tool calls,
answer formats), so what a sequence is about to write has often been written already: by its
siblings in the group (Seer, arXiv 2511.14617), by earlier rollouts of the same prompt (DAS, arXiv
2511.13841; SuffixDecoding, arXiv 2411.04975), or in its own context (prompt lookup, vLLM's
`ngram`). The drafter finds the longest earlier occurrence of the sequence's last tokens and
proposes what followed it there; where its last `key_len` tokens occur nowhere it backs off to
shorter keys, down to `min_key` (a verify forward on a GPU costs the same with or without a
draft, so a weak draft is better than none there; the speculator prices short matches by their
own acceptance, so where verifying costs, the policy drops them). A draft only saves time; the verifier decides what is emitted
(`sampling.verify_draft`), so a bad draft never changes the output.

Pure and bounded: no clock, no I/O, at most `max_prompts` prompts of `max_sequences` sequences.
A restarted engine starts empty and fills again from the turns it generates.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

Key = tuple[int, ...]


@dataclass
class _Prompt:
    sequences: deque[tuple[str, list[int]]] = field(default_factory=deque)
    """(group id, tokens) of the responses kept, oldest first."""
    keys: deque[set[Key]] = field(default_factory=deque)
    """The index keys each kept response added (what to clean when it is dropped)."""
    first: int = 0
    """The number of sequences dropped so far (index of `sequences[0]` in arrival order)."""
    index: dict[Key, deque[tuple[int, int]]] = field(default_factory=dict)
    """Key (`min_key` to `key_len` tokens) -> (sequence number, position after the key)."""


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: list[int]
    match: int
    """How many of the sequence's last tokens the source matched (0: no draft)."""
    source: str
    """'group' (a sibling), 'prompt' (an earlier rollout of the prompt), 'self' (its own context)
    or '' (none)."""


NO_DRAFT = Draft([], 0, "")


class SuffixDrafter:
    def __init__(
        self,
        key_len: int = 3,
        max_match: int = 32,
        max_sequences: int = 64,
        max_prompts: int = 512,
        per_key: int = 8,
        min_key: int = 1,
    ):
        if not 1 <= min_key <= key_len <= max_match:
            raise ValueError(
                f"need 1 <= min_key <= key_len <= max_match, got {min_key}, {key_len} and {max_match}"
            )
        self.key_len, self.max_match, self.min_key = key_len, max_match, min_key
        self.max_sequences, self.max_prompts, self.per_key = max_sequences, max_prompts, per_key
        self._prompts: OrderedDict[str, _Prompt] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(p.sequences) for p in self._prompts.values())

    def add(self, prompt_id: str, group_id: str, tokens: Sequence[int]) -> None:
        """A response (one turn's generated tokens) of a sample of `group_id` on `prompt_id`."""
        if len(tokens) <= self.min_key:
            return
        p = self._prompts.pop(prompt_id, None) or _Prompt()
        self._prompts[prompt_id] = p  # most recently used last
        while len(self._prompts) > self.max_prompts:
            self._prompts.popitem(last=False)
        if len(p.sequences) >= self.max_sequences:
            self._drop_oldest(p)
        number = p.first + len(p.sequences)
        seq = list(tokens)
        p.sequences.append((group_id, seq))
        keys: set[Key] = set()
        for k in range(self.min_key, self.key_len + 1):
            for end in range(k, len(seq)):
                key = tuple(seq[end - k : end])
                keys.add(key)
                p.index.setdefault(key, deque(maxlen=self.per_key)).append((number, end))
        p.keys.append(keys)

    def _drop_oldest(self, p: _Prompt) -> None:
        """Forgets the oldest response: only the keys it added are visited, not the whole index."""
        p.sequences.popleft()
        p.first += 1
        for key in p.keys.popleft():
            at = p.index.get(key)
            while at and at[0][0] < p.first:
                at.popleft()
            if at is not None and not at:
                del p.index[key]

    def draft(self, prompt_id: str, group_id: str, context: Sequence[int], k: int) -> Draft:
        """Up to `k` tokens that followed the longest earlier occurrence of `context`'s last tokens:
        in a sibling's response first, then in any response to the prompt, then in `context`
        itself. Longer matches win; among equal ones a sibling's, then the most recent. Keys of
        `key_len` tokens first; only where none occurs, shorter ones (down to `min_key`)."""
        if k <= 0:
            return NO_DRAFT
        for key_len in range(min(self.key_len, len(context)), self.min_key - 1, -1):
            found = self._draft(prompt_id, group_id, context, k, key_len)
            if found.tokens:
                return found
        return NO_DRAFT

    def _draft(self, prompt_id: str, group_id: str, context: Sequence[int], k: int, key_len: int) -> Draft:
        """The earlier responses whose tokens before a position end as `context` does (at least
        `key_len` of them) vote on each drafted token in turn, each weighted by how long its match
        is (a longer shared history predicts better; SuffixDecoding, arXiv 2411.04975, also
        drafts the most frequent continuation); a candidate that disagrees with a drafted token
        stops voting. Ties go to a sibling, then to the most recent."""
        key = tuple(context[-key_len:])
        p = self._prompts.get(prompt_id)
        cands: list[tuple[list[int], int, int, bool]] = []  # (tokens, position, match, sibling)
        if p is not None:
            for number, end in reversed(p.index.get(key, ())):
                group, seq = p.sequences[number - p.first]
                if end < len(seq):
                    cands.append((seq, end, self._match(context, seq, end), group == group_id))
        best = NO_DRAFT
        if cands:
            longest = max(c[2] for c in cands)
            tokens: list[int] = []
            sibling = False
            while cands and len(tokens) < k:
                votes: dict[int, tuple[int, bool, int]] = {}
                for rank, (seq, end, match, sib) in enumerate(cands):
                    at = end + len(tokens)
                    if at < len(seq):
                        w, s, r = votes.get(seq[at], (0, False, rank))
                        votes[seq[at]] = (w + match, s or sib, min(r, rank))
                if not votes:
                    break
                token = max(votes, key=lambda t: (votes[t][0], votes[t][1], -votes[t][2]))
                sibling = sibling or (not tokens and votes[token][1])
                tokens.append(token)
                cands = [
                    c
                    for c in cands
                    if c[1] + len(tokens) - 1 < len(c[0]) and c[0][c[1] + len(tokens) - 1] == token
                ]
            best = Draft(tokens, longest, "group" if sibling else "prompt")
        if best.match >= self.max_match:
            return best
        own = self._own(context, k, key_len)
        return own if own.match > best.match else best

    def _match(self, context: Sequence[int], seq: Sequence[int], end: int) -> int:
        """How many tokens before `end` in `seq` equal the last tokens of `context` (at most
        `max_match`)."""
        n = 0
        limit = min(self.max_match, end, len(context))
        while n < limit and seq[end - 1 - n] == context[-1 - n]:
            n += 1
        return n

    def _own(self, context: Sequence[int], k: int, kl: int) -> Draft:
        """Prompt lookup: the latest earlier occurrence of the last `kl` tokens in the context
        itself (searched as bytes, in C: contexts are thousands of tokens and this runs every step)."""
        hay = array("q", context).tobytes()
        needle = hay[-8 * kl :]
        stop = len(hay) - 8  # an occurrence must end before the context does
        while stop > 0:
            at = hay.rfind(needle, 0, stop)
            if at < 0:
                return NO_DRAFT
            if at % 8 == 0:
                end = at // 8 + kl
                return Draft(list(context[end : end + k]), self._match(context, context, end), "self")
            stop = at + len(needle) - 1
        return NO_DRAFT
