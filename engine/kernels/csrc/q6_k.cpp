// Q6_K's products (quant.h).
#include "quant.h"

LAB_GGUF_OPS(q6_k, Q6_K)
