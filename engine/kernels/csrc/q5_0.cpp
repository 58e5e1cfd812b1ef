// Q5_0's products (quant.h).
#include "quant.h"

LAB_GGUF_OPS(q5_0, Q5_0)
