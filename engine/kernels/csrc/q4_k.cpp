// Q4_K's products (quant.h) and 8-bit products (a8.h).
#include "a8.h"

LAB_GGUF_OPS(q4_k, Q4_K)
LAB_A8_OPS(q4_k, A8Q4_K)
