"""BM25 retrieval over a local JSONL corpus shipped with the project; in-process, no network."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.tool_sandbox.outcome import Status
from services.tool_sandbox.tools.base import SandboxRun, Tool, ToolResult

_TOKEN = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(
    ["a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "has", "have", "how", "in", "is", "it", "its", "of", "on", "or", "that", "the", "this", "to", "was", "what", "when", "where", "which", "who", "why", "will", "with"]
)  # fmt: skip


def tokenize(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text.lower()) if t not in _STOPWORDS]


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    title: str
    text: str


class BM25Index:
    """Okapi BM25 (k1, b) with the non-negative idf variant, over title + text."""

    def __init__(self, documents: list[Document], k1: float = 1.5, b: float = 0.75) -> None:
        self.documents = documents
        self.k1, self.b = k1, b
        self._postings: dict[str, dict[int, int]] = {}
        self._lengths: list[int] = []
        for i, doc in enumerate(documents):
            counts = Counter(tokenize(f"{doc.title} {doc.text}"))
            self._lengths.append(sum(counts.values()))
            for term, tf in counts.items():
                self._postings.setdefault(term, {})[i] = tf
        self._avg_length = sum(self._lengths) / max(len(self._lengths), 1)

    def idf(self, term: str) -> float:
        n = len(self._postings.get(term, ()))
        return math.log(1 + (len(self.documents) - n + 0.5) / (n + 0.5))

    def search(self, query: str, k: int = 5) -> list[tuple[Document, float]]:
        scores: dict[int, float] = {}
        for term in set(tokenize(query)):
            idf = self.idf(term)
            for i, tf in self._postings.get(term, {}).items():
                norm = self.k1 * (1 - self.b + self.b * self._lengths[i] / self._avg_length)
                scores[i] = scores.get(i, 0.0) + idf * tf * (self.k1 + 1) / (tf + norm)
        ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]
        return [(self.documents[i], score) for i, score in ranked]


def load_corpus(path: Path) -> list[Document]:
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Document(id=str(r["id"]), title=r.get("title", ""), text=r["text"]) for r in rows]


class SearchTool(Tool):
    name = "search"
    description = "Search the local reference corpus (BM25); returns the top-k passages with scores."
    snippet_chars = 400

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.index: BM25Index | None = None

    def schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": 1000},
                "k": {"type": "integer", "minimum": 1, "maximum": 20},
            },
            "required": ["query"],
            "additionalProperties": False,
        }

    async def start(self) -> None:
        self.index = BM25Index(load_corpus(self.settings.corpus_path()))

    async def call(self, args: dict[str, Any], sandbox: SandboxRun, timeout_s: float) -> ToolResult:
        if self.index is None:
            await self.start()
        assert self.index is not None
        hits = self.index.search(args["query"], args.get("k", 5))
        payload = [
            {"id": d.id, "title": d.title, "score": round(s, 4), "text": d.text[: self.snippet_chars]}
            for d, s in hits
        ]
        return ToolResult(status=Status.OK, payload=json.dumps(payload, ensure_ascii=False))
