/* train — `meshtrain train`: one process or many (mpirun), any layout. The run's parts are
 * files of their own (train_run.h): its set-up, its steps, its report. */
#include <stdlib.h>
#include "train.h"
#include "comm.h"
#include "ops.h"
#include "tensor.h"
#include "train_run.h"

void train_free(TrainRun *r) {
    step_free(&r->st);
    tensor_parallel_fused_close();
    parallel_free(r->par);  /* first: it waits for collectives still in flight into the buffers */
    acts_free(&r->a);
    model_free(&r->m);
    loader_free(&r->loader);
    shard_close(&r->train);
    shard_close(&r->val);
    comm_free(&r->tie);
    free(r->stages);
    schedule_free(&r->sc);
    free(r->stage_cost);
    mesh_free(&r->mesh);
    comm_free(&r->world);
    free(r->settings);
}

int cmd_train(Config *c) {
    TrainRun r;
    train_setup(&r, c);
    TrainTotals t = train_loop(&r);
    int rc = train_report(&r, &t);
    train_free(&r);
    comm_world_finalize();
    return rc;
}
