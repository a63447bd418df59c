/* meshtrain — parses the command line and dispatches to one subcommand. */
#include <stdio.h>
#include <string.h>
#include "commands.h"
#include "config.h"
#include "env.h"
#include "util.h"

typedef struct { const char *name; int mask; int (*run)(Config *); const char *help; } Command;

static const Command COMMANDS[] = {
    {"train", CMD_TRAIN, cmd_train, "train a model (or resume=PATH a run)"},
    {"prepare", CMD_PREPARE, cmd_prepare, "TinyStories text -> train.bin / val.bin token shards"},
    {"tokenize", CMD_TOKENIZE, cmd_tokenize, "text on stdin -> ids on stdout (decode=true: ids -> text)"},
    {"sample", CMD_SAMPLE, cmd_sample, "generate text from a checkpoint"},
    {"eval", CMD_EVAL, cmd_eval, "validation loss of a checkpoint"},
    {"estimate", CMD_ESTIMATE, cmd_estimate, "parameters, FLOPs and memory of a run, before running it"},
    {"export", CMD_EXPORT, cmd_export, "a checkpoint -> a Hugging Face folder (Llama, Mixtral or Qwen2-MoE; safetensors, config, tokenizer)"},
    {"plot", CMD_PLOT, cmd_plot, "a training log -> one SVG picture of the run (loss, lr, tokens/s)"},
    {"plan", CMD_PLAN, cmd_plan, "the fastest layouts of a model that fit a cluster, predicted (try=K: and run)"},
    {"calibrate", CMD_CALIBRATE, cmd_calibrate, "measures this machine's ops, collectives and copies into a profile for plan"},
};
#define N_COMMANDS ((int)(sizeof COMMANDS / sizeof COMMANDS[0]))

/* What this binary can run on (scripts probe it: make train picks the GPU model). */
static void built_with(FILE *f) {
#ifdef MESHTRAIN_CUDA
    const char *cuda = "cuda";
#else
    const char *cuda = "no cuda (nvcc was not found at build time)";
#endif
#ifdef MESHTRAIN_NCCL
    const char *nccl = ", nccl";
#else
    const char *nccl = "";
#endif
    fprintf(f, "\nbuilt with: cpu, %s%s\n", cuda, nccl);
}

static void commands(FILE *f) {
    fprintf(f, "usage: meshtrain <command> [key=value ...]\n\ncommands:\n");
    for (int i = 0; i < N_COMMANDS; i++) fprintf(f, "  %-10s %s\n", COMMANDS[i].name, COMMANDS[i].help);
    fprintf(f, "  %-10s %s\n", "help", "every key of every command, with its default (help <command>: one command)");
}

static void usage(FILE *f) {
    commands(f);
    built_with(f);
}

static int help(const char *which) {
    int found = !which;
    for (int i = 0; i < N_COMMANDS; i++) found |= which && !strcmp(which, COMMANDS[i].name);
    if (!found) die_once(EXIT_BAD_INPUT, "help: unknown command '%s' (see 'meshtrain help')", which);
    commands(stdout);
    for (int i = 0; i < N_COMMANDS; i++) {
        if (which && strcmp(which, COMMANDS[i].name)) continue;
        printf("\nmeshtrain %s keys:\n", COMMANDS[i].name);
        config_print_help(COMMANDS[i].mask);
    }
    built_with(stdout);  /* last, where the README says to look */
    return 0;
}

int main(int argc, char **argv) {
    /* Under a launcher every rank parses the same command line: its errors print once. */
    int rank, size;
    if (argc > 0 && argv[0] && argv[0][0]) set_program_name(argv[0]);
    if (env_launcher(&rank, &size)) set_log_rank(rank, size);
    int unwired = env_unwired_tasks();
    if (unwired)
        die_once(EXIT_BAD_INPUT, "srun started %d tasks but MPI did not connect them: no PMIx or PMI in their "
                 "environment (use srun --mpi=pmix, or mpirun inside the allocation)", unwired);
    hooks_check();  /* a malformed hook: one line, exit 2, before anything runs */
    if (argc < 2) { usage(stderr); return EXIT_BAD_INPUT; }
    const char *name = argv[1];
    if (!strcmp(name, "help") || !strcmp(name, "--help") || !strcmp(name, "-h")) {
        if (argc > 3) die_once(EXIT_BAD_INPUT, "help takes one command at most (see 'meshtrain help')");
        return help(argc > 2 ? argv[2] : NULL);
    }
    for (int i = 0; i < N_COMMANDS; i++) {
        if (strcmp(name, COMMANDS[i].name)) continue;
        Config c;
        char err[1024];
        config_defaults(&c);
        if (config_parse(&c, COMMANDS[i].mask, argc - 2, argv + 2, err, sizeof err)) die_once(EXIT_BAD_INPUT, "%s", err);
        return COMMANDS[i].run(&c);
    }
    die_once(EXIT_BAD_INPUT, "unknown command '%s' (see 'meshtrain help')", name);
}
