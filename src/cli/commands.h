/* commands — one function per subcommand; main.c parses the command line and dispatches.
 * train.c: train. infer.c: eval, sample, estimate. text.c: prepare, tokenize. export.c: export.
 * plot.c: plot. plan_cmd.c: plan, calibrate. */
#ifndef MESHTRAIN_COMMANDS_H
#define MESHTRAIN_COMMANDS_H
#include "config.h"
#include "train.h" /* cmd_train */

int cmd_eval(Config *c);
int cmd_sample(Config *c);
int cmd_estimate(Config *c);
int cmd_prepare(Config *c);
int cmd_tokenize(Config *c);
int cmd_export(Config *c);
int cmd_plot(Config *c);
int cmd_plan(Config *c);
int cmd_calibrate(Config *c);
/* The path this program was started by (argv[0]), for the commands plan prints. */
void set_program_name(const char *argv0);
const char *program_name(void);
#endif
