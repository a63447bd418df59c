/* Tests of src/train/run.c: the cards' peaks MFU divides by, and the disk-space check (a
 * world of one: its verdict against a folder's real free space). */
#include "comm.h"
#include "run.h"
#include "test.h"
#include "util.h"
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

static void test_card_peaks(void) {
    /* the names the driver gives, as nvidia-smi prints them */
    CHECK(card_peak_flops("NVIDIA H200") == 989.4e12, "H200 SXM");
    CHECK(card_peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12, "H100 SXM");
    CHECK(card_peak_flops("NVIDIA H100 PCIe") == 756e12, "H100 PCIe: not the SXM's");
    CHECK(card_peak_flops("NVIDIA H200 NVL") == 835e12, "H200 NVL: not the SXM's");
    CHECK(card_peak_flops("NVIDIA GH200 480GB") == 989.4e12, "GH200");
    CHECK(card_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12, "A100");
    CHECK(card_peak_flops("NVIDIA L40S") == 362.1e12 && card_peak_flops("NVIDIA L40") == 181e12, "L40S before L40");
    CHECK(card_peak_flops("NVIDIA A10G") == 70e12 && card_peak_flops("NVIDIA A10") == 125e12, "A10G before A10");
    CHECK(card_peak_flops("Tesla T4") == 0 && card_peak_flops("") == 0 && card_peak_flops(NULL) == 0, "unknown: 0");
}

static void test_disk_space(void) {
    Comm world;
    comm_world_init(&world, 0);
    struct statvfs sv;
    CHECK(statvfs("/tmp", &sv) == 0, "statvfs /tmp");
    double free_b = (double)sv.f_bavail * (double)sv.f_frsize;
    Fail f = {0};
    DiskNeed fits[2] = {{"/tmp/x/ckpt.bin", "the checkpoint", 1024}, {"/tmp/x/log.jsonl", "the log", 1024}};
    CHECK(check_disk_space(&world, fits, 2, &f) == 0 && f.code == 0, "a few bytes fit: %s", f.msg);
    /* two needs on one file system are summed: each fits alone, together they do not */
    DiskNeed halves[2] = {{"/tmp/ckpt.bin", "the checkpoint", free_b * 0.6}, {"/tmp/log.jsonl", "the log", free_b * 0.6}};
    Fail g = {0};
    CHECK(check_disk_space(&world, halves, 2, &g) == -1 && g.code == EXIT_BAD_INPUT, "summed needs refused");
    CHECK(strstr(g.msg, "not enough disk space in /tmp: the checkpoint and the log will take about") != NULL,
          "the message names both: %s", g.msg);
    /* a need of no bytes (a rank that writes no log) is not checked */
    DiskNeed none[1] = {{"/nonexistent/folder/ckpt.bin", "the checkpoint", 0}};
    Fail h = {0};
    CHECK(check_disk_space(&world, none, 1, &h) == 0, "nothing to write: %s", h.msg);
    comm_world_finalize();
}

int main(void) {
    RUN(test_card_peaks);
    RUN(test_disk_space);
    return TEST_SUMMARY();
}
