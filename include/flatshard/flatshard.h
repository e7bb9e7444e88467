// FlatShard: fully sharded data-parallel training on LibTorch. The umbrella header.
#pragma once

#include "flatshard/build.h"
#include "flatshard/checkpoint.h"
#include "flatshard/comm_hooks.h"
#include "flatshard/communicator.h"
#include "flatshard/errors.h"
#include "flatshard/fully_shard.h"
#include "flatshard/grad_scaler.h"
#include "flatshard/memory.h"
#include "flatshard/optim.h"
#include "flatshard/recompute.h"
#include "flatshard/schedule.h"
#include "flatshard/sequential_units.h"
#include "flatshard/shard.h"
#include "flatshard/stream.h"
#include "flatshard/unit.h"
#include "flatshard/world.h"
