/* env — the one module that reads the environment. Settings are keys (train/config); what
 * comes from the environment is what a launcher tells a process (its rank, the job's size)
 * and meshtrain's hooks: switches for measuring, debugging and fault tests (MESHTRAIN_*),
 * none of which a training run needs. Each hook has one entry in a table (its name, the
 * values it takes, what it does), one parser reads them all, and a malformed value ends
 * the run in one line with exit status 2 (hooks_check, at start-up). A run writes the hooks
 * set into its log's first line, beside the keys; hooks that make results wrong on purpose
 * (skipping copies, injected faults) are announced there and in the run's header. */
#ifndef MESHTRAIN_ENV_H
#define MESHTRAIN_ENV_H
#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    HOOK_PROFILE,             /* "1": per-op times at exit, synchronised; "events": from CUDA events */
    HOOK_TIMELINE,            /* step S: that step's GPU timeline on every rank */
    HOOK_TIMELINE_LEADS,      /* 1: the host's lead at every compute mark too */
    HOOK_CUDA_SYNC,           /* 1: wait after every kernel, so a fault names its kernel */
    HOOK_CUDNN_LIB,           /* path of the cuDNN library to load */
    HOOK_PP_SKIP_COPIES,      /* 1: the pipeline's copy-engine transfers skipped (timing; wrong results) */
    HOOK_CE_BUFFER_BYTES,     /* the copy-engine all-reduce's buffer, bytes (pieces: a test hook) */
    HOOK_OFFLOAD_STAGING,     /* 1: lean offload stages fp32 gradients as for bf16 (a test hook) */
    HOOK_FAULT_KILL,          /* rank:step: that rank dies (SIGKILL) as that step starts */
    HOOK_FAULT_HANG,          /* rank:step: that rank stops responding as that step starts */
    HOOK_FAULT_NAN_STEP,      /* step: its training loss is NaN */
    HOOK_FAULT_NAN_VAL_STEP,  /* step: its validation loss is NaN */
    HOOK_FAULT_TERM_VAL_STEP, /* step: rank 0 gets SIGTERM as its validation begins */
    HOOK_FAULT_HOST_ALLOC,    /* 1: host (pinned) allocations for offload fail */
    HOOK_FAULT_OVERFLOW,      /* rank:step,step,...: that rank's gradient overflows (inf) in those steps */
    HOOK_FAKE_MEMAVAILABLE,   /* bytes: the available memory the checks see */
    HOOK_MOE_SKEW,            /* S: a fixed selection bias S/1000 (X-1-e)/(X-1) on expert e (a skewed router) */
    HOOK_COUNT
} Hook;

/* Parses every hook set (once; later calls do nothing): a malformed value, or an unknown
 * MESHTRAIN_* name that is one edit from a hook's, ends the run (die_once, exit 2). */
void hooks_check(void);
/* Whether the hook is set (to a non-empty value; a flag, to 1). */
int hook_on(Hook h);
/* An integer hook's value, dflt where unset. */
long long hook_int(Hook h, long long dflt);
/* A text hook's value (NULL where unset). */
const char *hook_text(Hook h);
/* A rank:step hook: 1 with *rank and *step where set. */
int hook_rank_step(Hook h, int *rank, int *step);
/* A rank:step,step,... hook: 1 where it is set, names this rank and lists this step. */
int hook_rank_at_step(Hook h, int rank, int step);
/* The hooks set, as "NAME=value" calls of fn, in the table's order; wrong: the hook makes
 * the run's results wrong or is a fault (for the header's warning). */
void hooks_each(void (*fn)(void *ctx, const char *name, const char *value, int wrong), void *ctx);
/* The hook's variable name ("MESHTRAIN_PROFILE"). */
const char *hook_name(Hook h);

/* Whether a launcher started this process for MPI (mpirun, or srun with PMIx or PMI-2:
 * OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMI_RANK or PMIX_RANK is set), and its rank on its machine
 * (0 without one; under srun SLURM_LOCALID). */
int env_launched(void);
int env_local_rank(void);
/* The launcher's view of this process before MPI starts (Open MPI, PMI, PMIx, Slurm): 1
 * with its rank and the job's size, 0 when no launcher started it. */
int env_launcher(int *rank, int *size);
/* N when srun started this process as one of N > 1 tasks without giving it what MPI needs
 * to join them (srun --mpi=none, or a cluster whose default MPI plugin is none): each would
 * be a world of one, or MPI would refuse; 0 otherwise. */
int env_unwired_tasks(void);
/* Started by Open MPI's mpirun, and whether its kill delay after a forwarded signal was set
 * (OMPI_MCA_odls_base_sigkill_timeout). */
int env_open_mpi(void);
int env_mpirun_kill_delay_set(void);
/* Sets a variable a library reads at its start (CUDA's) unless the user set it. */
void env_default(const char *name, const char *value);

#ifdef __cplusplus
}
#endif
#endif
