/* Link shim for building llama.cpp's own quantization sources (from the oracle cache) into
 * test_formats_vs_ggml: the few ggml core symbols they reference, and wrappers exposing ggml's
 * inline fp16/bf16 conversions. Nothing here is used by moraine itself. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "ggml-impl.h"
#include "ggml.h"

float ggml_table_f32_f16[1 << 16];

void moraine_ggml_oracle_init(void) {
  for (int i = 0; i < (1 << 16); ++i) ggml_table_f32_f16[i] = GGML_FP16_TO_FP32((ggml_fp16_t)i);
}

void ggml_abort(const char* file, int line, const char* fmt, ...) {
  fprintf(stderr, "ggml oracle aborted at %s:%d\n", file, line);
  abort();
}
size_t ggml_row_size(enum ggml_type type, int64_t ne) {
  (void)type;
  (void)ne;
  abort(); /* only reached by quantize_* entry points the test does not call */
}
size_t ggml_type_size(enum ggml_type type) {
  (void)type;
  abort();
}
const char* ggml_type_name(enum ggml_type type) {
  (void)type;
  return "?";
}

uint16_t moraine_ggml_fp32_to_fp16(float f) { return GGML_FP32_TO_FP16(f); }
float moraine_ggml_fp16_to_fp32(uint16_t h) { return GGML_FP16_TO_FP32(h); }
uint16_t moraine_ggml_fp32_to_bf16(float f) { return GGML_FP32_TO_BF16(f).bits; }
