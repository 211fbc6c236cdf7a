// Process-wide log sink of the core (like llama_log_set). By default warnings
// and errors go to stderr; a host (or the Python module) installs its own sink.
#pragma once

#include <functional>
#include <string>

namespace pagedcore {

enum class LogLevel : int { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40 };

using LogSink = std::function<void(LogLevel level, const std::string& message)>;

// Replaces the sink; an empty function restores the default (stderr, warnings
// and errors only). Not thread-safe: set it before engines run. An exception
// thrown by the sink is caught (the message then goes to stderr).
void set_log_sink(LogSink sink);

void log_message(LogLevel level, const std::string& message);

}  // namespace pagedcore
