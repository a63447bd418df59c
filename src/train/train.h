/* train — `meshtrain train` (train.c), for the command line to dispatch to. */
#ifndef MESHTRAIN_TRAIN_H
#define MESHTRAIN_TRAIN_H
#include "config.h"

int cmd_train(Config *c);
#endif
