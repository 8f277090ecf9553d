"""The demo's workload (scripts/rag_workload.py) against a stand-in server: it asks every
question as a chat of the shared documents, prints the answer in words beside the tokens KVLens
supplied, and its exit status says when answers differ between rounds or KVLens supplied
nothing."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.lib import rag_set
from scripts import rag_workload


class StandIn:
    """Answers each question with its known answer; ``kvlens_tokens`` after the first flush;
    ``drift``: answers change after the first flush."""

    def __init__(self, kvlens_tokens: int = 700, drift: bool = False) -> None:
        self.kvlens_tokens, self.drift = kvlens_tokens, drift
        self.flushes, self.chats = 0, []
        by_text = {q.text: q for q in rag_set.QUESTIONS}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def reply(self, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                self.reply({"data": [{"id": "smollm2"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path == "/reset_prefix_cache":
                    owner.flushes += 1
                    return self.reply({})
                owner.chats.append(body)
                user = body["messages"][-1]["content"]
                question = by_text[user.rsplit(rag_set.QUESTION_PREFIX, 1)[1]]
                said = (
                    f"It is {question.answer}." if not (owner.drift and owner.flushes) else "I do not know."
                )
                loaded = owner.kvlens_tokens if owner.flushes else 0
                cached = loaded + 64  # and 64 from vLLM's own prefix cache
                self.reply(
                    {
                        "choices": [{"message": {"role": "assistant", "content": said}}],
                        "usage": {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": cached}},
                        "kv_transfer_params": {
                            "num_lmcache_cached_tokens": loaded,
                            "kvlens": {"loaded_tokens": {"cpu": loaded} if loaded else {}},
                        },
                    }
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def stand_in(request) -> Iterator[StandIn]:
    server = StandIn(**getattr(request, "param", {}))
    thread = threading.Thread(target=server.server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


def test_every_answer_is_printed_in_words_beside_what_kvlens_supplied(stand_in, capsys):
    assert rag_workload.main(["--url", stand_in.url, "--rounds", "2", "--questions", "3"]) == 0
    out = capsys.readouterr().out
    asked = rag_workload.demo_questions(3)
    assert len({q.document for q in asked}) == 3  # one question about each of three documents
    for q in asked:
        assert q.text in out and f"-> It is {q.answer}." in out
    assert "answers holding the known fact: 3 of 3" in out and "outputs identical across rounds" in out
    assert stand_in.flushes == 1 and len(stand_in.chats) == 6
    chat = stand_in.chats[0]
    assert chat["temperature"] == 0.0 and chat["messages"] == rag_set.messages(asked[0])
    rows = [line.split()[:6] for line in out.splitlines() if line.startswith(("    1 ", "    2 "))]
    # round, question, prompt tokens: computed, from vLLM's prefix cache, loaded by KVLens
    assert rows == [["1", str(i), "900", "836", "64", "0"] for i in (1, 2, 3)] + [
        ["2", str(i), "900", "136", "64", "700"] for i in (1, 2, 3)
    ]


@pytest.mark.parametrize("stand_in", [{"drift": True}], indirect=True)
def test_answers_that_change_between_rounds_fail_the_run(stand_in, capsys):
    assert rag_workload.main(["--url", stand_in.url, "--rounds", "2", "--questions", "2"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("stand_in", [{"kvlens_tokens": 0}], indirect=True)
def test_expect_kvlens_fails_when_kvlens_supplied_nothing(stand_in):
    assert (
        rag_workload.main(["--url", stand_in.url, "--rounds", "2", "--questions", "1", "--expect-kvlens"])
        == 3
    )


def test_a_server_that_is_not_there_is_an_error_not_a_traceback(capsys):
    assert rag_workload.main(["--url", "http://127.0.0.1:9", "--rounds", "1"]) == 2
    assert "error:" in capsys.readouterr().err
