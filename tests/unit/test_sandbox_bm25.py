from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.tools.search import BM25Index, Document, load_corpus, tokenize

DOCS = [
    Document("1", "cats", "the cat sat on the mat"),
    Document("2", "dogs", "dogs chase cats in the park"),
    Document("3", "json", "json encoder and decoder for python objects"),
]


def test_tokenize_lowercases_and_drops_stopwords() -> None:
    assert tokenize("The Cat, and THE dog!") == ["cat", "dog"]


def test_ranks_matching_documents_first() -> None:
    index = BM25Index(DOCS)
    hits = index.search("json decoder", k=2)
    assert hits[0][0].id == "3"
    assert len(hits) == 1


def test_rarer_terms_weigh_more() -> None:
    index = BM25Index(DOCS)
    assert index.idf("json") > index.idf("cats")


def test_no_match_returns_nothing() -> None:
    assert BM25Index(DOCS).search("quantum chromodynamics") == []


def test_shipped_corpus_answers_stdlib_questions() -> None:
    index = BM25Index(load_corpus(SandboxSettings().corpus_path()))
    assert len(index.documents) > 100
    top = [doc.id for doc, _ in index.search("regular expression matching", k=3)]
    assert "stdlib/re" in top
