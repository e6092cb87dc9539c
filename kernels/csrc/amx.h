/* AMX's tile configuration and Linux's grant of the tile state, for the kernels that run tiles
 * (panel_gemm.c, greedy_head.c). Include it behind their __AMX_TILE__ guard only. */
#ifndef TANDEM_AMX_H
#define TANDEM_AMX_H

#include <stdint.h>
#include <stdlib.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* oneDNN's ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) caps the ISA of torch's matmuls; the tiles
 * here follow it, so that one variable runs the whole process as on a CPU without AMX. An ISA
 * name without "AMX" in it, other than ALL and DEFAULT, is one below AMX. */
static int amx_below_isa_cap(void)
{
    const char *cap = getenv("ONEDNN_MAX_CPU_ISA");
    if (!cap || !*cap)
        cap = getenv("DNNL_MAX_CPU_ISA");
    if (!cap || !*cap || !strcasecmp(cap, "ALL") || !strcasecmp(cap, "DEFAULT"))
        return 0;
    for (const char *c = cap; c[0] && c[1] && c[2]; c++)
        if (!strncasecmp(c, "AMX", 3))
            return 0;
    return 1;
}

/* Linux gives a process AMX's tile state only when asked, once (for all its threads). */
static int amx_permitted(void)
{
    static int state; /* 0: not asked yet, 1: granted, -1: refused or capped */
    if (!state)
        state = !amx_below_isa_cap() && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
            ? 1 : -1;
    return state > 0;
}

#endif
