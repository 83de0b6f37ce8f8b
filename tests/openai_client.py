"""kiln-server against the official OpenAI Python client.

Usage: python tests/openai_client.py KILN_SERVER KILN

Starts KILN_SERVER (embedded model, an API key, a free port), then asks it
for chat and text completions, streamed and not, through `openai`, and checks
each greedy text equals what `KILN generate` / `KILN chat` print for the same
request. Run by `cargo xtask test` in the venv of .ci/requirements-openai.txt.
"""

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import openai

KEY = "kiln-test-key"


def kiln(binary, *args):
    out = subprocess.run([binary, *args], capture_output=True, text=True, check=True)
    assert out.stdout.endswith("\n"), out.stdout
    return out.stdout[:-1]


def start(server):
    env = dict(os.environ, KILN_API_KEY=KEY)
    proc = subprocess.Popen(
        [server, "--port", "0"], env=env, stderr=subprocess.PIPE, text=True
    )
    for line in proc.stderr:
        sys.stderr.write("[server] " + line)
        if "listening on " in line:
            base = line.split("listening on ")[1].split()[0]
            break
    else:
        sys.exit(f"kiln-server exited before listening ({proc.wait()})")
    # Keep reading stderr so that the server never blocks writing it.
    threading.Thread(
        target=lambda: [sys.stderr.write("[server] " + l) for l in proc.stderr],
        daemon=True,
    ).start()
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(base + "/health") as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit("kiln-server never became ready")
        time.sleep(0.05)


def check(name, got, expected):
    if got != expected:
        sys.exit(f"FAIL {name}: got {got!r}, expected {expected!r}")
    print(f"ok   {name}: {got!r}")


def main():
    server, kiln_bin = sys.argv[1], sys.argv[2]
    proc, base = start(server)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        check("models", [m.id for m in client.models.list()], ["embedded"])

        expected = kiln(kiln_bin, "generate", "--max-tokens", "24", "Hello")
        r = client.completions.create(
            model="embedded", prompt="Hello", max_tokens=24, temperature=0
        )
        check("completion", r.choices[0].text, expected)
        check("completion finish", r.choices[0].finish_reason, "length")
        check("completion usage", r.usage.completion_tokens, 24)
        stream = client.completions.create(
            model="embedded",
            prompt="Hello",
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        check(
            "completion stream",
            "".join(c.choices[0].text for c in chunks if c.choices),
            expected,
        )
        check("completion stream usage", chunks[-1].usage.total_tokens, 30)

        expected = kiln(kiln_bin, "chat", "--model", "embedded", "--max-tokens", "16", "Say hi")
        messages = [{"role": "user", "content": "Say hi"}]
        r = client.chat.completions.create(
            model="embedded", messages=messages, max_completion_tokens=16, temperature=0
        )
        check("chat", r.choices[0].message.content, expected)
        stream = client.chat.completions.create(
            model="embedded",
            messages=messages,
            max_completion_tokens=16,
            temperature=0,
            stream=True,
        )
        text = "".join(
            c.choices[0].delta.content or "" for c in stream if c.choices
        )
        check("chat stream", text, expected)

        try:
            client.chat.completions.create(model="embedded", messages=messages, n=2)
            sys.exit("FAIL n=2 was accepted")
        except openai.BadRequestError as e:
            check("n=2 refused", (e.status_code, e.body["param"]), (400, "n"))
        try:
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
            sys.exit("FAIL a wrong key was accepted")
        except openai.AuthenticationError as e:
            check("wrong key", e.status_code, 401)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    check("exit status after SIGTERM", code, 0)


if __name__ == "__main__":
    main()
