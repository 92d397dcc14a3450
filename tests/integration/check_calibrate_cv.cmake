# dpbalance-calibrate's command line on the shared H200 rows: --cv 5 prints a "5-fold CV, ours"
# MAPE line within a little of the figure docs/cost-model.md publishes for the same command,
# and well below the refitted published form's; the model it writes (--out) records that MAPE
# as "cv_mape" (the plugin's default guard margin, docs/flags.md).
#   cmake -DCALIBRATE=path/to/dpbalance-calibrate -DDATA=integration/calibrate/data -P ...
# Each case: rows file|kernel (none: without grid)|the published CV MAPE (docs/cost-model.md).
set(cases
  "attention_fa2_gqa.train.jsonl|none|0.080"
  "attention_fa2_packed.train.jsonl|none|0.064"
  "attention_fa2_packed.train.jsonl|fa2-packed-h200|0.041")
set(failed 0)
foreach(entry IN LISTS cases)
  string(REPLACE "|" ";" case "${entry}")
  list(GET case 0 rows)
  list(GET case 1 kernel)
  list(GET case 2 published)
  set(model_out "${CMAKE_CURRENT_BINARY_DIR}/calibrate_cv_${kernel}.json")
  set(args --train ${DATA}/${rows} --cv 5 --out ${model_out})
  if(NOT kernel STREQUAL "none")
    list(APPEND args --kernel ${kernel})
  endif()
  execute_process(COMMAND ${CALIBRATE} ${args} OUTPUT_VARIABLE out ERROR_VARIABLE err
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(SEND_ERROR "${rows} (kernel ${kernel}): exit ${rc}: ${err}")
    set(failed 1)
    continue()
  endif()
  if(NOT out MATCHES "5-fold CV, ours: +mape ([0-9.]+)")
    message(SEND_ERROR "${rows} (kernel ${kernel}): no '5-fold CV, ours: mape' line in:\n${out}")
    set(failed 1)
    continue()
  endif()
  set(ours ${CMAKE_MATCH_1})
  if(NOT out MATCHES "5-fold CV, published form refit: +mape ([0-9.]+)")
    message(SEND_ERROR "${rows}: no published-form CV line")
    set(failed 1)
    continue()
  endif()
  set(refit ${CMAKE_MATCH_1})
  # The published figure is rounded to 3 decimals; allow 0.005 for that and the fold shuffle.
  execute_process(COMMAND awk "BEGIN { exit !(${ours} <= ${published} + 0.005 && ${ours} < ${refit} / 4) }"
                  RESULT_VARIABLE within)
  file(READ ${model_out} model)
  if(NOT model MATCHES "\"cv_mape\": ([0-9.e-]+)")
    message(SEND_ERROR "${rows} (kernel ${kernel}): no cv_mape in the --out model:\n${model}")
    set(failed 1)
    continue()
  endif()
  execute_process(COMMAND awk "BEGIN { d = ${CMAKE_MATCH_1} - ${ours}; exit !(d < 1e-4 && d > -1e-4) }"
                  RESULT_VARIABLE recorded)
  if(NOT recorded EQUAL 0)
    message(SEND_ERROR "${rows} (kernel ${kernel}): the model records cv_mape ${CMAKE_MATCH_1}, the CV line says ${ours}")
    set(failed 1)
  endif()
  if(within EQUAL 0)
    message(STATUS "ok: ${rows} (kernel ${kernel}): CV MAPE ${ours} (docs ${published}, published form refit ${refit})")
  else()
    message(SEND_ERROR "${rows} (kernel ${kernel}): CV MAPE ${ours}, expected <= ${published} + 0.005 (docs/cost-model.md) and < ${refit} / 4")
    set(failed 1)
  endif()
endforeach()
if(failed)
  message(FATAL_ERROR "calibrate --cv check failed")
endif()
