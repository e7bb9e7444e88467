// FlatShard: fully sharded data-parallel training on LibTorch. The umbrella header.
#pragma once

#include "flatshard/communicator.h"
#include "flatshard/errors.h"
#include "flatshard/shard.h"
#include "flatshard/stream.h"
#include "flatshard/world.h"
