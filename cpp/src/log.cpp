#include "pagedcore/log.h"

#include <cstdio>
#include <exception>

namespace pagedcore {

namespace {

LogSink& sink() {
  static LogSink instance;
  return instance;
}

const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarning: return "WARNING";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}

}  // namespace

void set_log_sink(LogSink new_sink) { sink() = std::move(new_sink); }

void log_message(LogLevel level, const std::string& message) {
  if (sink()) {
    // NOTE: messages are logged from inside engine calls (a preemption in the
    // middle of schedule()); a sink that throws must not leave the engine
    // half-way through a change, so its exception stops here.
    try {
      sink()(level, message);
      return;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pagedcore: the log sink failed (%s); message follows\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "pagedcore: the log sink failed; message follows\n");
    }
  } else if (level < LogLevel::kWarning) {
    return;
  }
  std::fprintf(stderr, "pagedcore %s: %s\n", level_name(level), message.c_str());
}

}  // namespace pagedcore
