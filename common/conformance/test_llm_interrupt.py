"""Ctrl-C during `generate`, for real: SIGINT sent to a child process mid-generation leaves its LLM usable."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

from omnirun.testing import read_line_within

_CHILD = textwrap.dedent(
    """
    import json, sys, threading, time
    from omnirun import LLM, SamplingParams

    llm = LLM(device=sys.argv[1], max_total_tokens=16384, dtype="float32")
    short = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    expected = llm.generate("Hello", short, use_tqdm=False)[0].token_ids

    def announce():  # once the requests hold pages, they are running: time for the parent's SIGINT
        while not llm.kv_usage().pages_held:
            time.sleep(0.002)
        print("generating", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    try:
        # 16 requests to the end of the context: a thousand steps, seconds even on a fast GPU
        long = SamplingParams(temperature=0, max_new_tokens=None, ignore_eos=True)
        llm.generate(["Hello"] * 16, long, use_tqdm=False)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    usage = llm.kv_usage()
    after = llm.generate("Hello", short, use_tqdm=False)[0].token_ids
    print(json.dumps({
        "interrupted": interrupted,
        "pages_free": usage.pages_free,
        "pages_cached": usage.pages_cached,
        "pages_total": usage.pages_total,
        "held": usage.pages_held,
        "same_after": after == expected,
    }), flush=True)
    llm.close()
    """
)


def test_ctrl_c_during_generate_aborts_its_requests_and_the_llm_goes_on(device_name):
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, device_name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # (bounded: a child that hangs while loading or generating fails the test instead of holding the run)
        assert read_line_within(child, 300).strip() == "generating", child.stderr.read()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["interrupted"], "the long requests finished before the signal: make the work longer"
    assert report["held"] == {} and report["pages_free"] + report["pages_cached"] == report["pages_total"]
    assert report["same_after"]
