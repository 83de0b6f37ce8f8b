// q8_row.cu's arithmetic on the host, for kiln-xla's tests: q4_row_host.cpp
// built for 8-bit values (32 bytes a block; the offsets read and unused).
#define Q8_ROW
#include "q4_row_host.cpp"
