// Umbrella header for C++ hosts: the engine and everything it is built from.
#pragma once

#include "pagedcore/block_allocator.h"
#include "pagedcore/config.h"
#include "pagedcore/cpu_ops.h"
#include "pagedcore/engine.h"
#include "pagedcore/errors.h"
#include "pagedcore/free_block_queue.h"
#include "pagedcore/kv_cache_manager.h"
#include "pagedcore/log.h"
#include "pagedcore/prefix_hash_table.h"
#include "pagedcore/scheduler.h"
#include "pagedcore/sequence.h"
#include "pagedcore/step_batch.h"
#include "pagedcore/types.h"
#include "pagedcore/version.h"
