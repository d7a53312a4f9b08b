#!/usr/bin/env bash
# Red team (issue 23): the adversarial cases end to end, each a test that asserts the saved data
# survived (or was rebuilt from what survived) and that the message names the cause.
#
#   scripts/red_team.sh              # every case, the slow ones (real 1- and 2-rank runs) included
#   FAST=1 scripts/red_team.sh       # only the cases that need no training run (seconds)
#
#   case                                                  test
#   1  a corrupt checkpoint "saved" again, a good purged  test_healing.py (rewritten, moved aside; purge)
#   2  a step directory without COMPLETE.json             test_healing.py (never blocks the save)
#   3  a truncated final/model.safetensors                test_healing.py (named; a rerun rebuilds it)
#   4  a refused launch rewrites config.yaml              test_healing.py (config.yaml unchanged)
#   5  an edited config.json under model.path             test_fingerprint.py (refused by key)
#   6  the corpus changed between runs                   test_fingerprint.py (refused; accepted on request)
#   7  a damaged cache entry                              test_cache_checksums.py (rebuilt, named)
#   8  _target_ model ignoring positions/segments         test_contract.py (packing probe, every kind)
#   9  V-1 logit columns                                  test_contract.py (contract at start-up)
#   10 a factory that raises (train, verify)              test_contract.py (model error, rc 2)
#   11 wrong-shape forwards                               test_contract.py
#   12 run.dir read-only or a file                        test_errors.py
#   13 Bloom eager attention with packing                 test_contract.py
#   14 data=hf on a directory that is not a dataset       test_errors.py
#   15 a lone surrogate in a prompt                       test_serve.py (400, generate rc 2)
#   16 custom run served, unfinished export, layout line, test_errors.py
#      a resume path that does not exist
#   17 a finished run that exits non-zero                 test_teardown.py, test_stress.py
#   18 a pickled object in trainer.pt / rng_rank*.pt      test_safe_loading.py (refused, never run)
#   19 an open server on 0.0.0.0                          test_server_access.py
set -euo pipefail
cd "$(dirname "$0")/.."
marker=()
export DDPTRAIN_STRESS_RUNS="${DDPTRAIN_STRESS_RUNS:-8}"  # 8 short 2-rank runs per strategy, two at a time
[[ "${FAST:-0}" == 1 ]] && marker=(-m "not slow")
exec python -m pytest -q "${marker[@]}" tests/runs/test_healing.py tests/runs/test_fingerprint.py tests/data/test_cache_checksums.py \
    tests/models/test_output_contract.py tests/train/test_errors.py tests/runs/test_safe_loading.py tests/train/test_teardown.py \
    tests/serving/test_server_access.py "tests/serving/test_serve.py::test_every_bad_request_gets_a_400_naming_the_field_and_the_rule" \
    "tests/serving/test_serve.py::test_every_bad_chat_request_gets_a_400_naming_the_field_and_the_rule" \
    "tests/serving/test_serve.py::test_generate_cli_continues_prompts_like_load_model_and_refuses_what_does_not_fit" \
    tests/train/test_stress.py
