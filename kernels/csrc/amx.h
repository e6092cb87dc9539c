/* AMX's tile configuration and Linux's grant of the tile state, for the kernels that run tiles
 * (panel_gemm.c, greedy_head.c). Include it behind their __AMX_TILE__ guard only. */
#ifndef TANDEM_AMX_H
#define TANDEM_AMX_H

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Linux gives a process AMX's tile state only when asked, once (for all its threads). */
static int amx_permitted(void)
{
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    if (!state)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state > 0;
}

#endif
