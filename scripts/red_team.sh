#!/usr/bin/env bash
# Red team: the adversarial cases end to end, each a test that asserts the saved data
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
#   20 run.dir=. among the user's files, /, ~            test_rundir.py (refused by name, nothing written)
#   21 a LoRA base config.json edited after training     test_lora.py (load_model, export, serving refuse)
#   22 a damaged or truncated servable/ copy             test_serve.py (rebuilt; a serve error, not SafetensorError)
#   23 a data glob that reaches run.dir                  test_rundir.py (config error, nothing written)
#   24 a 20 MB chat request beside small ones            test_serve.py (400 at once, others not held up)
#   25 a misspelt LoRA target, alpha=inf                 test_lora.py
#   26 an export into final/ or a checkpoint step        test_export.py
#   27 plan --world-size 0, --ranks-per-node 5 of 16     test_memory_plan.py
#   28 an sft glob matching a directory, a latin-1
#      template, a LoRA run whose base is gone           test_sft.py, test_lora.py (messages, not tracebacks)
#   29 every example skipped                             test_sft.py (the skip counts in the message)
#   30 a looping/flooding/huge template, a huge line     test_sft.py (named errors), progress every 10 s
#   31 n: true / 1.0                                     test_serve.py (400)
#   32 a full fine-tune DPO resumed over other weights   test_dpo.py (refused by key, nothing written;
#      at model.path                                     the weights put back: resumes exactly)
#   33 a damaged reference cache entry: flipped bits,    test_dpo.py (warned by name, recomputed, the
#      truncated, no array, too short, NaN, no checksum  clean run's loss)
#   34 an export into best/, servable-best/,             test_export.py (refused in one line, nothing
#      tensorboard/, previous/ of a run                  written), test_layout.py (one list, every writer)
#   35 a DPO memory plan                                 test_memory_plan.py (2 rows a pair, the frozen copy)
#   40 an empty or whitespace-only task choice            test_tasks.py (data error naming file and line)
#   41 an MLflow server that is not there                 test_trackers.py (warned within seconds, training goes on)
#   42 a _target_ head wider than its logits              test_chunked_engine.py (config error naming both widths)
#   43 evaluate on a tampered final/, a corrupted best/,
#      a task directory or non-UTF-8 task; a non-UTF-8
#      trainer.eval_tasks file                            test_tasks.py (one line, rc 2, no traceback)
#   44 a 4 MB deeply nested JSON body                     test_serve.py (400 naming body, not a 500)
#   45 a NaN val_loss under early stopping; a stopped
#      run relaunched with more steps                     test_early_stopping.py (messages that say what happened)
#   46 every preference pair skipped, pairs cut, the
#      byte tokenizer for data=preference                 test_preference.py (counts per reason, the right names)
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
    tests/train/test_stress.py \
    "tests/runs/test_rundir.py::test_a_run_dir_holding_the_users_own_files_is_refused_by_name_and_nothing_is_touched" \
    "tests/runs/test_rundir.py::test_the_home_directory_is_never_a_run_dir" \
    "tests/runs/test_rundir.py::test_the_filesystem_root_is_never_a_run_dir" \
    "tests/runs/test_rundir.py::test_a_run_dir_with_a_tilde_is_in_the_home_directory" \
    "tests/runs/test_rundir.py::test_a_data_glob_that_reaches_the_run_dir_is_refused_by_name_and_nothing_is_written" \
    "tests/models/test_lora.py::test_an_edited_base_config_is_refused_by_load_model_export_and_serving" \
    "tests/models/test_lora.py::test_every_lora_target_must_name_an_adaptable_module" \
    "tests/models/test_lora.py::test_lora_config_rules_name_the_key_and_the_value" \
    "tests/models/test_lora.py::test_exporting_a_lora_run_whose_base_is_gone_names_the_missing_base" \
    "tests/serving/test_serve.py::test_a_damaged_servable_copy_is_rebuilt_and_a_truncated_model_directory_is_a_serve_error" \
    "tests/serving/test_serve.py::test_a_20_mb_request_gets_its_400_at_once_and_does_not_slow_the_small_ones" \
    "tests/commands/test_export.py::test_an_export_into_a_directory_the_run_manages_is_refused_and_writes_nothing" \
    "tests/train/test_memory_plan.py::test_a_bad_world_size_or_ranks_per_node_names_the_flag_the_value_and_the_rule" \
    "tests/data/test_sft.py::test_a_corpus_whose_every_example_is_skipped_says_how_many_and_why" \
    "tests/data/test_sft.py::test_a_glob_that_matches_a_directory_and_a_template_that_is_not_utf8_are_data_errors" \
    "tests/data/test_sft.py::test_a_template_that_loops_or_floods_and_a_huge_template_or_line_are_named_errors" \
    "tests/data/test_sft.py::test_preprocessing_says_how_far_it_got_while_one_record_takes_long" \
    "tests/train/test_tasks.py::test_a_task_line_that_breaks_the_format_is_named_with_its_rule" \
    "tests/train/test_trackers.py::test_an_mlflow_server_that_is_not_there_warns_within_seconds_and_training_goes_on" \
    "tests/engine/test_chunked_engine.py::test_a_target_model_whose_head_is_wider_than_its_logits_is_refused_naming_both_widths" \
    "tests/train/test_tasks.py::test_the_evaluate_command_names_a_damaged_run_or_a_bad_task_file_in_one_line" \
    "tests/train/test_tasks.py::test_a_task_file_that_is_not_utf8_in_trainer_eval_tasks_is_a_data_error_before_training" \
    "tests/train/test_early_stopping.py::test_a_validation_loss_that_is_not_finite_stops_the_run_with_a_message_that_says_so" \
    "tests/train/test_early_stopping.py::test_relaunching_a_stopped_run_with_more_steps_says_it_stopped_early_and_how_to_train_on" \
    "tests/data/test_preference.py::test_a_corpus_whose_every_pair_is_skipped_says_how_many_were_read_and_why_each_was_dropped" \
    "tests/data/test_preference.py::test_pairs_cut_by_truncation_are_warned_in_plain_words" \
    "tests/data/test_preference.py::test_the_byte_tokenizer_by_default_is_refused_in_the_words_of_data_preference" \
    "tests/train/test_dpo.py::test_a_full_fine_tune_does_not_resume_against_other_weights_at_model_path" \
    "tests/train/test_dpo.py::test_a_damaged_reference_cache_entry_is_recomputed_with_a_warning_never_trained_against" \
    "tests/commands/test_export.py::test_an_export_into_a_run_dirs_best_or_servable_best_is_refused_on_the_command_line" \
    tests/runs/test_layout.py \
    "tests/train/test_memory_plan.py::test_a_dpo_plan_counts_two_rows_per_pair_and_the_frozen_reference_of_a_full_fine_tune" \
    "tests/train/test_memory_plan.py::test_a_lora_dpo_plan_holds_no_reference_copy"
