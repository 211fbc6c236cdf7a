#include "pagedcore/log.h"

#include <cstdio>

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
    sink()(level, message);
  } else if (level >= LogLevel::kWarning) {
    std::fprintf(stderr, "pagedcore %s: %s\n", level_name(level), message.c_str());
  }
}

}  // namespace pagedcore
