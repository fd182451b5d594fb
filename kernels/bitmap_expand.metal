// Metal kernel of mlx_flash.bitmap: expand ENDOR bitmap rows into dense rows.
//
// Not a standalone translation unit: mx.fast.metal_kernel takes the kernel *body*; this file
// holds sections introduced by `//== section: <name> ==` lines, split by
// mlx_flash.gather_ffn.split_sections ("header", "expand"). Text before the first marker is
// ignored.
//
// Encoded row layout (see mlx_flash/bitmap.py): at byte 0, NWORDS little-endian uint32
// bitmap words (element j non-zero iff bit j % 32 of word j / 32); at 4*NWORDS a uint32
// count; at VAL_OFF (= 4*NWORDS + 4) CAP packed values, in position order.
//
// Arguments:
//   enc   const device uint8_t*  [k, STRIDE] encoded rows, row-contiguous
//   out   device U*              [k, D] the bit patterns of the dense rows
// Template arguments:
//   U       unsigned type of the stored element bits (uint8_t, uint16_t, uint32_t): the
//           wrapper views the result as float16/bfloat16/float32, so values (incl. -0.0)
//           are copied bit for bit
//   D, NWORDS, STRIDE, VAL_OFF, CAP  row length, bitmap words, bytes per encoded row,
//           byte offset of the values, value slots
// Grid: (NWORDS, k). Thread (w, r) sums the popcounts of the words before w (the index of
// its first non-zero among the packed values) and writes the 32 elements of word w.

//== section: header ==

//== section: expand ==
    uint w = thread_position_in_grid.x;
    uint r = thread_position_in_grid.y;
    if (w >= NWORDS) {
        return;
    }
    const device uint8_t* row = enc + (size_t)r * STRIDE;
    const device uint32_t* bm = (const device uint32_t*)row;
    const device U* vals = (const device U*)(row + VAL_OFF);
    uint base = 0;
    for (uint i = 0; i < w; ++i) {
        base += popcount(bm[i]);
    }
    uint word = bm[w];
    device U* o = out + (size_t)r * D;
    for (uint b = 0; b < 32; ++b) {
        uint j = w * 32 + b;
        if (j >= D) {
            break;
        }
        U v = U(0);
        if ((word >> b) & 1u) {
            v = base < CAP ? vals[base] : U(0);
            base++;
        }
        o[j] = v;
    }
