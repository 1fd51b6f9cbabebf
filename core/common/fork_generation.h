// Which process an object was made in. After fork() the child has a copy of the parent's
// memory but none of its threads: a stream's worker, a communicator's progress thread, a
// checkpoint's writer are absent there, and their locks may be held forever. An object
// that records fork_generation() when it is made can tell, in a child, that it belongs to
// the parent, and must then be left alone (never waited for, never destroyed).
#pragma once

#include <cstdint>

namespace hps {

// 0 in the process that loaded the library; each fork() gives the child one more than its
// parent had. A relaxed atomic load.
uint64_t fork_generation() noexcept;

}  // namespace hps
