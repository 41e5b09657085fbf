"""Drafts for speculative decoding from what this engine already generated for the same prompt.

GRPO samples every prompt several times, and an agent's turns repeat their structure (tool calls,
answer formats), so what a sequence is about to write has often been written already: by its
siblings in the group (Seer, arXiv 2511.14617), by earlier rollouts of the same prompt (DAS, arXiv
2511.13841; SuffixDecoding, arXiv 2411.04975), or in its own context (prompt lookup, vLLM's
`ngram`). The drafter finds the longest earlier occurrence of the sequence's last tokens and
proposes what followed it there. A draft only saves time; the verifier decides what is emitted
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
    """Key (the last `key_len` tokens) -> (sequence number, position after the key)."""


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
    ):
        if key_len < 1 or max_match < key_len:
            raise ValueError(f"need 1 <= key_len <= max_match, got {key_len} and {max_match}")
        self.key_len, self.max_match = key_len, max_match
        self.max_sequences, self.max_prompts, self.per_key = max_sequences, max_prompts, per_key
        self._prompts: OrderedDict[str, _Prompt] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(p.sequences) for p in self._prompts.values())

    def add(self, prompt_id: str, group_id: str, tokens: Sequence[int]) -> None:
        """A response (one turn's generated tokens) of a sample of `group_id` on `prompt_id`."""
        if len(tokens) <= self.key_len:
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
        k = self.key_len
        keys: set[Key] = set()
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
        itself. Longer matches win; among equal ones a sibling's, then the most recent."""
        if k <= 0 or len(context) < self.key_len:
            return NO_DRAFT
        best = NO_DRAFT
        key = tuple(context[-self.key_len :])
        p = self._prompts.get(prompt_id)
        if p is not None:
            for number, end in reversed(p.index.get(key, ())):
                group, seq = p.sequences[number - p.first]
                if end >= len(seq):
                    continue
                match = self._match(context, seq, end)
                source = "group" if group == group_id else "prompt"
                sibling_on_a_tie = match == best.match and source == "group" and best.source != "group"
                if match > best.match or sibling_on_a_tie:
                    best = Draft(seq[end : end + k], match, source)
        if best.match >= self.max_match:
            return best
        own = self._own(context, k)
        return own if own.match > best.match else best

    def _match(self, context: Sequence[int], seq: Sequence[int], end: int) -> int:
        """How many tokens before `end` in `seq` equal the last tokens of `context` (at most
        `max_match`)."""
        n = 0
        limit = min(self.max_match, end, len(context))
        while n < limit and seq[end - 1 - n] == context[-1 - n]:
            n += 1
        return n

    def _own(self, context: Sequence[int], k: int) -> Draft:
        """Prompt lookup: the latest earlier occurrence of the last tokens in the context itself
        (searched as bytes, in C: contexts are thousands of tokens and this runs every step)."""
        kl = self.key_len
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
